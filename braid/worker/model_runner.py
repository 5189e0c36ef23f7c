"""Runs the model on one rank: loads its shard, owns its KV cache, executes step plans."""

from __future__ import annotations

import functools
import gc
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from braid.compiler import configure_compiler
from braid.config import EngineConfig
from braid.distributed.comm import SwitchableCommunicator
from braid.layers.forward_batch import ForwardBatch
from braid.layers.fused import configure_compile
from braid.layers.ggml_weight import keep_blocks, set_input_rounding
from braid.layers.quant import make_weight_forms
from braid.layers.weight_rounding import round_linear_weights
from braid.loader.model_config import ModelConfig
from braid.loader.weights import load_weights, with_progress
from braid.models.registry import model_class
from braid.overlap.operations import execute, execute_overlapped
from braid.platform import process_namespace, release_free_memory
from braid.step import RankReady, StepPlan, StepResult
from braid.trace import tracer
from braid.worker.compiled_step import (
    CompiledDecodeStep,
    CompiledPieces,
    elapsed,
    graph_cache_key,
    mark_static,
    piece_warm_up_plans,
    warm_up_plans,
)
from braid.worker.draft import RankDraft
from braid.worker.kernels import plan_kernels
from braid.worker.memory import kv_cache_bytes, trimming, weight_bytes
from braid.worker.mtp import MTPDraft
from braid.worker.sampler import postprocess
from braid.worker.split import split_step

# How long a collective may wait while the ranks compile the pieces of a warm-up step (each
# rank compiles a piece as it first reaches it, one possibly well before the other)
COMPILE_COMM_TIMEOUT_S = 1800.0


def checkpoint_weights(model_path: str, config: ModelConfig, dtype: torch.dtype | None = None,
                       keep_blocks: bool = False):
    """Lazy (name, weight) pairs of a GGUF file (with `keep_blocks`, its quantized tensors as
    blocks; else from braid's cache of its dequantised weights in `dtype` when there is one)
    or of a safetensors folder (an AWQ/GPTQ one's integer weights as blocks likewise)."""
    if Path(model_path).is_file():
        from braid.loader.weight_cache import cached_gguf_weights

        weights = (cached_gguf_weights(model_path, dtype)
                   if dtype is not None and not keep_blocks else None)
        if weights is not None:
            return weights
        from braid.loader.gguf import iterate_gguf

        return iterate_gguf(model_path, config, keep_blocks)
    from braid.loader.awq_gptq import integer_checkpoint_weights, integer_weights
    from braid.loader.safetensors import iterate_safetensors

    weights = iterate_safetensors(model_path)
    scheme = integer_weights(config.extra.get("quantization_config"))
    return weights if scheme is None else integer_checkpoint_weights(weights, scheme, keep_blocks)


def rank_device(device: str, rank: int) -> torch.device:
    """`cuda` means one GPU per rank (cuda:rank, modulo the GPUs visible); else as given."""
    if device == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)


class ModelRunner:
    """One rank's model shard and KV cache, and its compiled steps (`prepare_compiled`)."""

    def __init__(self, engine: EngineConfig, config: ModelConfig,
                 comm: SwitchableCommunicator) -> None:
        self.engine = engine
        self.config = config
        self.comm = comm
        self.device = rank_device(engine.parallel.device, comm.rank)
        torch.manual_seed(engine.seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(engine.seed)
        cls = model_class(config)
        self.model = cls(config, comm, engine.torch_dtype)
        mtp_layer = self.model.attach_mtp() if engine.speculative.method == "mtp" else None
        # The forward pass's outputs: logits, and the hidden states a draft layer reads
        self.outputs = ("logits", "hidden") if self.model.keeps_hidden else ("logits",)
        self.kernels = plan_kernels(engine, self.model)
        cache_dtype = engine.torch_dtype if engine.cache else None
        weights = checkpoint_weights(engine.model, config, cache_dtype, self.kernels.gguf_blocks)
        if comm.rank == 0:
            weights = with_progress(weights, "loading weights", delay_s=2.0)
        load_weights(self.model, trimming(weights))
        keep_blocks(self.model)
        if self.kernels.rounded_weights:
            round_linear_weights(self.model, self.kernels.rounded_weights)
        set_input_rounding(self.model, self.kernels.round_block_inputs,
                           self.kernels.block_inputs_all_rows, engine.torch_dtype)
        release_free_memory()
        self.model.to(self.device).eval()
        self._packed = make_weight_forms(self.model, self.kernels)
        configure_compile(self.kernels.fused_elementwise, self.kernels.operators,
                          announce=comm.rank == 0)
        self.operations = self.model.operations()
        for attn in self.model.attention_layers():
            attn.allocate_cache(engine.kv_cache.num_blocks, engine.kv_cache.block_size,
                                engine.kv_torch_dtype, self.device, self.kernels)
        self.decode_graph: CompiledDecodeStep | None = None
        self.pieces: CompiledPieces | None = None
        self.mtp = (None if mtp_layer is None else
                    MTPDraft(mtp_layer, comm, engine.kv_cache.block_size, self.device))
        self.draft = RankDraft(engine, comm) if engine.speculative.method == "draft" else None

    def ready(self) -> RankReady:
        """Whether steps can be compiled here, whether the graphs are saved already, and the
        rank's kernels."""
        not_compiled = self.kernels.not_compiled
        runners = [self] + ([self.draft.runner] if self.draft else [])
        cached = all(r.kernels.not_compiled is not None or r._decode_step.cached()
                     for r in runners)
        models = [r.model for r in runners]
        return RankReady(not_compiled, not_compiled is None and cached,
                         self.kernels.describe(), sum(map(weight_bytes, models)),
                         sum(map(kv_cache_bytes, models)), os.getpid(), process_namespace(),
                         decode_graph=not_compiled is None and not self.model.keeps_hidden)

    @functools.cached_property
    def _decode_step(self) -> CompiledDecodeStep:
        """The decode graphs' holder, keyed once (the key hashes braid's code and the model's
        files) for the status and the compile."""
        kv_blocks = self.engine.kv_cache.num_blocks
        key = graph_cache_key(self.engine, self.engine.model, self.comm.rank,
                              self.comm.world_size, self._packed, kv_blocks
                              ) if self.engine.cache else None
        torch_collectives = self.comm.world_size > 1 and self.engine.parallel.comm == "torch"
        return CompiledDecodeStep(self.model, key, cpp_wrapper=not torch_collectives)

    @torch.inference_mode()
    def prepare_compiled(self) -> str:
        """Load (or compile and save) the decode graphs, compile the pieces on warm-up steps
        that write only block 0 (never handed out; zeroed again after), and use them from the
        next step on; a line saying what it did. Every rank runs it at the same point."""
        if self.kernels.not_compiled is not None:
            return f"steps run eager ({self.kernels.not_compiled})"
        if self.pieces is not None:
            return "compiled steps ready"
        line = self._compile()
        if self.draft is not None:
            line += f"; the draft model's: {self.draft.runner.prepare_compiled()}"
        return line

    def _compile(self) -> str:
        start = time.perf_counter()
        # The graphs hold the real collectives whatever the last step skipped (--skip-comm): a
        # graph traced over the no-op ones would be saved and loaded by later launches.
        self.comm.skip = False
        configure_compiler()
        mark_static(self.model)
        block_size = self.engine.kv_cache.block_size
        # A model that also outputs its hidden states runs its decode steps as pieces: the
        # decode graphs return the logits alone
        decode = None if self.model.keeps_hidden else self._decode_step
        loaded = compiled = 0
        if decode is not None:
            loaded, compiled = decode.prepare({
                one: ForwardBatch(plan, block_size, self.device)
                for one, plan in warm_up_plans(block_size).items()})
        decode_s = time.perf_counter() - start
        pieces = CompiledPieces(self.operations)
        # One step per row-count class of the GEMMs (packed weights up to the plan's
        # `packed_max_rows`) that the step budget reaches. Not one of a single row, which
        # dynamo specialises: a one-token prompt is rare, and its pieces compile when it comes
        # (both ranks at once, so neither waits on the other past its collective timeout);
        # warming it up cost seconds of every start.
        rows = self.kernels.packed_max_rows if self._packed else None
        tokens = [64] if rows is None else [64, rows + 64]
        tokens = [n for n in tokens if n <= max(64, self.engine.scheduler.max_num_batched_tokens)]
        overlap = self.engine.switches.overlap != "off"
        with self.comm.long_timeout(COMPILE_COMM_TIMEOUT_S):
            for plan in piece_warm_up_plans(block_size, tokens):
                execute(pieces.plain, ForwardBatch(plan, block_size, self.device), self.outputs)
                if overlap:
                    batch = ForwardBatch(plan, block_size, self.device)
                    execute_overlapped(pieces.staged, batch, batch, outputs=self.outputs)
        for attn in self.model.attention_layers():
            for cache in attn.cache_tensors():
                cache[0].zero_()
        self.decode_graph, self.pieces = decode, pieces
        gc.collect()  # compiling's garbage (graphs, traces) out of the heap for as long as we run
        release_free_memory()
        return (f"compiled steps ready in {elapsed(start)}: decode graphs {loaded} loaded, "
                f"{compiled} compiled ({decode_s:.0f} s); {pieces.kinds} kinds of pieces")

    @torch.inference_mode()
    def step(self, plan: StepPlan,
             receive_mask: Callable[[], np.ndarray] | None = None) -> StepResult | None:
        """Run one forward step; rank 0 returns tokens (and logprobs, logits if asked),
        the other ranks None. A plan with grammar rows has its bitmask from `receive_mask`,
        asked for once the logits are ready: the driver fills it while the forward runs."""
        self.comm.skip = plan.mode.skip_comm
        self.comm.compression = plan.mode.comm_compression
        if plan.mode.choice:
            tracer().instant(plan.mode.choice, "auto")
        drafts, draft_seconds = None, []
        if plan.draft is not None:
            with tracer().span("draft", "A"):
                drafts, draft_seconds = self.draft.fill(plan)
        outputs, path = self._forward(plan)
        result = None
        if self.comm.rank == 0:
            mask, waited = None, 0.0
            if plan.sampling is not None and len(plan.sampling.grammar_rows):
                start = time.perf_counter()
                with tracer().span("wait grammar mask", "sampler"):
                    mask = receive_mask()
                waited = time.perf_counter() - start
            result = postprocess(outputs["logits"], plan, self.generator, mask)
            result.path, result.grammar_wait_s = path, waited
            result.drafts, result.draft_seconds = drafts, draft_seconds
            if "pooled" in outputs:
                result.pooled = outputs["pooled"].cpu().numpy()
        if self.mtp is not None:
            with tracer().span("mtp draft", "A"):
                proposals = self.mtp.propose(plan, outputs["hidden"],
                                             None if result is None else result.tokens or [])
            if result is not None:
                result.proposals = proposals
        return result

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> torch.Tensor:
        """The logits of the plan's logit rows (a one-rank model: a draft's proposals)."""
        return self._forward(plan)[0]["logits"]

    def _forward(self, plan: StepPlan) -> tuple[dict[str, torch.Tensor], str]:
        """The step's outputs ("logits" of its logit rows, and "pooled" where it embeds) and
        the path it took (`STEP_PATHS`): the decode graph, or the operation list (with
        compiled pieces where prepared) straight or as two overlapped micro-batches (each
        computes its share of the rows, A's first). Steps with collectives skipped or
        compressed run eager: the graphs hold the plain ones; steps that embed run one batch
        outside the decode graph, which has no pooled output."""
        block_size = self.engine.kv_cache.block_size
        compiled = (self.pieces is not None and not plan.mode.skip_comm
                    and plan.mode.comm_compression == "none")
        pooling = plan.pool_segments is not None
        parts = (split_step(plan, self.engine.switches.tbo_token_distribution_threshold)
                 if plan.mode.overlap and not pooling else None)
        if parts is None:
            batch = ForwardBatch(plan, block_size, self.device)
            if (compiled and not pooling and self.decode_graph is not None
                    and self.decode_graph.handles(batch)):
                with tracer().span("decode graph", "A"):
                    return {"logits": self.decode_graph(batch)}, "graph"
            ops = self.pieces.plain if compiled else self.operations
            outputs = (*self.outputs, "pooled") if pooling else self.outputs
            return execute(ops, batch, outputs), "pieces" if compiled else "eager"
        ops = self.pieces.staged if compiled else self.operations
        out_a, out_b = execute_overlapped(ops, ForwardBatch(parts.a, block_size, self.device),
                                          ForwardBatch(parts.b, block_size, self.device),
                                          outputs=self.outputs)
        path = "pieces+overlap" if compiled else "eager+overlap"
        return {key: torch.cat([out_a[key], out_b[key]]) for key in self.outputs}, path
