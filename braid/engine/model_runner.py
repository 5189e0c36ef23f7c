"""Runs the model on one rank: loads its shard, owns its KV cache, executes step plans."""

from __future__ import annotations

from pathlib import Path

import torch

from braid.config import EngineConfig, ModelConfig
from braid.distributed.comm import SwitchableCommunicator
from braid.engine.batch import ForwardBatch, StepPlan, StepResult
from braid.engine.compiled_step import (
    CompiledDecodeStep,
    eager_decode_reads_kernel,
    step_compile_applies,
    use_decode_kernels,
    warm_up_plans,
)
from braid.engine.kv_cache import num_kv_blocks
from braid.engine.sampler import postprocess
from braid.layers.fused import configure_compile
from braid.layers.quant import pack_linear_layers, quantize_linear_layers
from braid.loader.weights import load_weights, with_progress
from braid.models.registry import model_class
from braid.overlap.operations import execute, execute_overlapped
from braid.overlap.split import split_step


def checkpoint_weights(model_path: str, config: ModelConfig, dtype: torch.dtype | None = None):
    """Lazy (name, weight) pairs of a GGUF file (from braid's cache of its dequantised weights
    in `dtype` when there is one) or of a safetensors folder."""
    if Path(model_path).is_file():
        from braid.loader.weight_cache import cached_gguf_weights

        weights = cached_gguf_weights(model_path, dtype) if dtype is not None else None
        if weights is not None:
            return weights
        from braid.loader.gguf import iterate_gguf

        return iterate_gguf(model_path, config)
    from braid.loader.safetensors import iterate_safetensors

    return iterate_safetensors(model_path)


def rank_device(device: str, rank: int) -> torch.device:
    """`cuda` means one GPU per rank (cuda:rank, modulo the GPUs visible); else as given."""
    if device == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)


class ModelRunner:
    """One rank's model shard and KV cache."""

    def __init__(self, engine: EngineConfig, config: ModelConfig,
                 comm: SwitchableCommunicator) -> None:
        self.engine = engine
        self.config = config
        self.comm = comm
        self.device = rank_device(engine.device, comm.rank)
        torch.manual_seed(engine.seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(engine.seed)
        cls = model_class(config)
        self.model = cls(config, comm, engine.torch_dtype)
        cache_dtype = engine.torch_dtype if engine.cache else None
        weights = checkpoint_weights(engine.model, config, cache_dtype)
        if comm.rank == 0:
            weights = with_progress(weights, "loading weights", delay_s=2.0)
        load_weights(self.model, weights)
        if engine.quantization == "int8":
            quantize_linear_layers(self.model)
        self.model.to(self.device).eval()
        compile_step = step_compile_applies(engine.compile, engine.device, comm.world_size,
                                            self.model)
        # A compiled step packs its own copies of the weights (inductor's freezing reads
        # row-major ones), so the model keeps them row-major.
        if engine.weight_packing and not compile_step:
            pack_linear_layers(self.model)
        configure_compile(engine.compile, engine.device, announce=comm.rank == 0)
        self.operations = self.model.operations()
        eager_kernel = not compile_step and eager_decode_reads_kernel(engine, self.model)
        self._allocate_kv_cache(tokens_innermost=compile_step or eager_kernel)
        if eager_kernel:
            use_decode_kernels(self.model, gemv=False)
        self.compiled_step = None
        if compile_step:
            self.compiled_step = CompiledDecodeStep(self.model, self.operations,
                                                    announce=comm.rank == 0)
            self._warm_up_compiled_step()

    @torch.inference_mode()
    def _warm_up_compiled_step(self) -> None:
        """Compile the decode step on dummy steps that write only block 0 (never handed out),
        zeroed again after."""
        plans = warm_up_plans(self.engine.block_size)
        if not self.compiled_step.warm_up([ForwardBatch(plan, self.engine.block_size,
                                                        self.device) for plan in plans]):
            self.compiled_step = None
        for attn in self.model.attention_layers():
            for cache in attn.cache_tensors():
                cache[0].zero_()

    def _allocate_kv_cache(self, tokens_innermost: bool) -> None:
        """`tokens_innermost`: the decode operator's layout (`PagedAttention` only)."""
        num_blocks = num_kv_blocks(self.engine.max_total_tokens, self.engine.block_size)
        layout = {"tokens_innermost": True} if tokens_innermost else {}
        for attn in self.model.attention_layers():
            attn.allocate_cache(num_blocks, self.engine.block_size, self.engine.kv_torch_dtype,
                                self.device, **layout)

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepResult | None:
        """Run one forward step; rank 0 returns tokens (and logprobs, logits if asked),
        the other ranks None."""
        self.comm.skip = plan.skip_comm
        logits = self._forward(plan)
        if self.comm.rank != 0:
            return None
        return postprocess(logits, plan, self.generator)

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits of the step's logit rows: one batch straight, or two micro-batches
        overlapped (each computes its share of the rows, A's first)."""
        block_size = self.engine.block_size
        parts = (split_step(plan, self.engine.tbo_token_distribution_threshold)
                 if plan.overlap else None)
        if parts is None:
            batch = ForwardBatch(plan, block_size, self.device)
            if self.compiled_step is not None and self.compiled_step.handles(batch):
                return self.compiled_step(batch)
            return execute(self.operations, batch)["logits"]
        out_a, out_b = execute_overlapped(self.operations,
                                          ForwardBatch(parts.a, block_size, self.device),
                                          ForwardBatch(parts.b, block_size, self.device))
        return torch.cat([out_a["logits"], out_b["logits"]])
