"""The decode step as one compiled graph (`--compile on`, one rank, CPU).

A decode step of a small model is mostly dispatch: at batch 1 SmolLM2-135M runs about 1,500
operators per token, and outside the weight GEMVs (15 ms, the memory floor) the eager step
spends about 12 ms calling them. `torch.compile` of the whole operation list, with inductor's
freezing (weights become constants, laid out for their GEMMs once), its C++ wrapper (the
kernels are called from C++, not Python) and max-autotune (each GEMM timed against
inductor's C++ templates, except for bf16 weights on CPUs without AMX: `inductor_config`),
fuses the elementwise work between GEMMs, drops the dispatch and reads int8 weights at
bandwidth. Measured on the 2-core AVX-512 host, per step in process:
bf16 batch 1 went from 27.5 to 15.0 ms and batch 32 from 59 to 46 ms; int8 batch 1 from 21.6
to 11.6 ms and batch 32 to 43 ms.

Decode attention in the graph is `decode_kernel`'s C++ operator (`use_decode_kernels`), or
`traced_decode_attention` where it does not fit or cannot be built: reductions that read the
keys through the block table, which inductor fuses (no gathered copy of the keys). The traced
kernel took the step from 15.0 to 12.1 ms at batch 1 (inductor's lowering of the gathers and
SDPA cost about 80 us a layer there); the operator took batch 32 (context 128-168, 2-core
Zen 5) from 36-39 to 31-32 ms a step, attention from 37% of it to 21%. The KV cache is laid
out for both (`PagedAttention.allocate_cache`, tokens innermost in each block), so a score is
summed as vector FMAs over a block's 16 tokens.

On CPUs with AVX512-BF16 the graph for one sequence runs its GEMMs through `decode_kernel`'s
GEMV operator (`use_decode_kernels`), which streams a layer's row-major weight, bf16 or int8,
faster than oneDNN or inductor's templates: SmolLM2's 270 MB of bf16 weights at about 44 GB/s
(6.1 ms of an 8.2-8.6 ms step, 2-core Zen 5); in process, steps of 9.1-9.5 ms against
10.2-11.5 ms with oneDNN's GEMMs, measured one after the other.

What stays out of the graph: prompt steps (already GEMM-bound), mixed steps, two-batch overlap
and tensor parallelism (the collectives are not traceable), and models whose attention is not
`PagedAttention` (MLA). Those steps run eager, on the row-major weights the model then keeps.

Shapes are dynamic (batch size and context width are symbols), so one graph serves every
batch of two or more sequences and one serves a single sequence (inductor specialises size
1). Both are compiled at start-up, announced: 2.5-3 minutes on that host, under a minute when
inductor's cache (`/tmp/torchinductor_$USER`) already holds them.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import CodeType, FunctionType

import numpy as np
import torch
import torch._dynamo.convert_frame
import torch._inductor.config
from torch import nn

from braid.config import EngineConfig, cpu_flags
from braid.engine.batch import DECODE_MIN_BLOCKS, ForwardBatch, StepPlan
from braid.layers import decode_kernel
from braid.layers.attention import PagedAttention
from braid.layers.quant import INT8_GRAPH_AT_BATCH, Quantizable
from braid.overlap.operations import execute

# freezing: parameters become constants, so weights are laid out for their GEMM once, at
# compile time; cpp_wrapper: the graph's kernels are called from generated C++; max_autotune:
# each GEMM is timed against inductor's own C++ GEMM templates at warm-up, which won at decode
# shapes (the 121 GEMMs of a SmolLM2 token, 2 cores, AVX-512: bf16 10.4 against 13.2 ms at
# one row and 13.7 against 16.6 at 32; int8 weights 6.8 against 11.2 ms at one row, where the
# template reads them at bandwidth and `_weight_int8pack_mm` does not). (Given as
# `torch.compile(options=...)` the settings did not take effect: 33 ms per step instead of 20.)
# assert_indirect_indexing off: no bounds check per indexed load (token ids are checked when a
# request is added; slots and block tables are the engine's own), 8-12% of decode attention.
_INDUCTOR_CONFIG = {"freezing": True, "cpp_wrapper": True, "max_autotune": True,
                    "max_autotune_gemm_backends": "CPP,ATEN", "assert_indirect_indexing": False}
# Except for bf16 weights on a CPU without AMX: there the templates convert each bf16 weight to
# fp32 and stream it at about 16 GB/s, where oneDNN reads 24-38 GB/s, yet autotuning on warm
# caches still picks them. oneDNN alone: bs 1 decode 1.11x, bs 32 the same (2-core Zen 4).
# A graph whose GEMMs read int8 weights keeps the templates (under oneDNN alone int8 / bf16
# at bs 1 fell from 1.94x to 1.32-1.37x there).
_DENSE_BF16_WITHOUT_AMX = {"max_autotune_gemm_backends": "ATEN"}
# The rows the graph for two or more sequences is tuned at (the templates are timed at the
# warm-up's size): a typical decode batch. Tuned at 2 rows, batch 32 ran 48 ms per step with
# bf16 weights and 77 with int8, against 46 and 43 tuned at 16.
WARM_UP_ROWS = 16
# Floats the step reads (the norms' epsilon) are constants of the graph, not inputs made into
# tensors on every call (0.6 ms of a batch-1 step's Python before the graph ran, profiled).
# Nothing a step varies is a float: sampling runs outside the graph.
_DYNAMO_CONFIG = {"specialize_float": True}


def inductor_config(model: nn.Module, one_sequence: bool) -> dict:
    """The inductor settings `model`'s decode graph for one sequence, or for several, is
    compiled under: by what its GEMMs read (int8 weights where `int8_applies` in that graph)."""
    has_int8 = any(isinstance(layer, Quantizable) and layer.int8 is not None
                   for layer in model.modules())
    reads_int8 = has_int8 and (one_sequence or INT8_GRAPH_AT_BATCH)
    dtype = next(model.parameters()).dtype
    if dtype == torch.bfloat16 and not reads_int8 and "amx_bf16" not in cpu_flags():
        return {**_INDUCTOR_CONFIG, **_DENSE_BF16_WITHOUT_AMX}
    return _INDUCTOR_CONFIG


def use_decode_kernels(model: nn.Module, gemv: bool = True) -> None:
    """`decode_kernel`'s operators wherever they fit, if they build: decode attention in every
    attention layer, prefill attention where `decode_kernel.prefill_fits` (bf16, AVX512-BF16)
    and, with `gemv` (the compiled step, whose graph reads row-major weights), the GEMV in
    every linear layer (the LM head included) for the weight its one-row product reads, int8
    or dense."""
    dtype = next(model.parameters()).dtype
    attention = [attn for attn in model.attention_layers()
                 if decode_kernel.attention_fits(attn.padded_heads, attn.k_cache, dtype)]
    linears = [layer for layer in model.modules() if gemv and isinstance(layer, Quantizable)
               and (decode_kernel.gemv_fits(layer.quantizable_weight()) if layer.int8 is None
                    else layer.int8.scales.dtype == torch.bfloat16  # not an fp16 model's
                    and decode_kernel.gemv_fits(layer.int8.values))]
    if (attention or linears) and decode_kernel.load():
        for attn in attention:
            attn.use_decode_kernel = True
            attn.use_prefill_kernel = decode_kernel.prefill_fits(
                attn.padded_heads, attn.num_kv_heads, attn.head_dim, dtype)
        for layer in linears:
            layer.gemv = True


def eager_decode_reads_kernel(engine: EngineConfig, model: nn.Module) -> bool:
    """Whether eager decode steps (every decode step but the compiled step's) read the KV
    cache through `decode_kernel`'s operator, laid out as the compiled step lays it out: on
    CPU, where every attention layer is a `PagedAttention` whose shapes the operator takes (a
    rank's unequal query groups padded to one grouped call), and the operator builds. Against
    gathering the blocks for SDPA (2-core Xeon with AMX, bf16, `ratio_bench.py` best of 2):
    decode bs 32 1.38x, bs 1 1.04x, prefill 8 x 512 1.04x (the layout's writes). An int8
    cache, whose gathered blocks SDPA needs dequantized, ran 0.65-0.69x the bf16 cache's speed
    at bs 32 gathered, 1.08x through the operator."""
    if engine.device != "cpu":
        return False
    for attn in model.attention_layers():
        if not (isinstance(attn, PagedAttention)
                and decode_kernel.shape_fits(attn.padded_heads, attn.num_kv_heads, attn.head_dim,
                                             engine.block_size, engine.torch_dtype,
                                             engine.kv_torch_dtype)):
            return False
    return decode_kernel.load()


def step_compile_applies(mode: str, device: str, world_size: int, model: nn.Module) -> bool:
    """Whether decode steps are compiled: `--compile on`, on CPU, one rank, and a model whose
    attention layers are all `PagedAttention`."""
    return (mode == "on" and device == "cpu" and world_size == 1
            and all(isinstance(a, PagedAttention) for a in model.attention_layers()))


class CompiledDecodeStep:
    """`execute(operations, batch)` compiled, for the steps `handles` accepts."""

    def __init__(self, model: nn.Module, operations: Sequence, announce: bool) -> None:
        self.operations = operations
        # Tensors the graph reads that are not parameters (int8 weights) would get symbolic
        # sizes under dynamic=True, which freezing then loses track of (inductor's C++ named
        # an undefined size).
        for layer in model.modules():
            if isinstance(layer, Quantizable) and layer.int8 is not None:
                torch._dynamo.mark_static(layer.int8.values)
                torch._dynamo.mark_static(layer.int8.scales)
        # The KV caches' sizes are fixed too. As symbols they took part in duck sizing: a
        # step's block-table width or batch equal to a cache size (2 KV heads, 16 tokens per
        # block) was unified with it and then pinned, and the next step recompiled.
        for attn in model.attention_layers():
            for cache in attn.cache_tensors():
                torch._dynamo.mark_static(cache)
        use_decode_kernels(model)
        self.announce = announce
        self._inductor_configs = {one: inductor_config(model, one) for one in (True, False)}
        self._forward = torch.compile(self._logits, dynamic=True)
        # Once warmed up, the code dynamo generated for each shape class (one sequence or
        # several), called without dynamo (see `__call__`)
        self._graphs: dict[bool, Callable] = {}

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        return execute(self.operations, batch)["logits"]

    @staticmethod
    def handles(batch: ForwardBatch) -> bool:
        """A decode step: one group of sequences, each with one new token, each a logit row
        (so the batch has no logits index)."""
        return (len(batch.attn_groups) == 1 and batch.attn_groups[0].meta.decode
                and batch.logits_index is None)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        # After warm-up a step runs the code dynamo generated for its shape class, without
        # dynamo: its guards (about 5,800 for SmolLM2, on the model's objects and the batch's
        # shapes) hold by construction, since the model is fixed by then and `handles` and
        # the batch layout (`DECODE_MIN_BLOCKS`) keep every step within what was traced
        # (inductor's wrapper still checks each input's sizes). Even checking only the guards
        # that tell the two graphs apart (dynamo's `skip_guard_eval_unsafe` stance) cost
        # about 1 ms of a 12-13 ms int8 step at batch 1. vLLM calls its graphs the same way.
        one_sequence = batch.num_tokens == 1
        graph = self._graphs.get(one_sequence)
        if graph is not None:
            return graph(self, batch)
        with (torch._inductor.config.patch(self._inductor_configs[one_sequence]),
              torch._dynamo.config.patch(_DYNAMO_CONFIG)):  # in force if a shape recompiles
            return self._forward(batch)

    def warm_up(self, batches: Sequence[ForwardBatch]) -> bool:
        """Compile now, on steps of each shape class; False (with a warning) if the compiler
        failed, and then decode steps run eager."""
        if self.announce:
            print("braid: compiling the decode step (--compile on: torch.compile with "
                  "freezing and max-autotune, a few minutes; under one when inductor's "
                  "cache holds it)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            for batch in batches:
                with dynamo_bytecode() as generated:
                    self(batch)
                graph = generated_function(generated, CompiledDecodeStep._logits)
                if graph is not None:
                    self._graphs[batch.num_tokens == 1] = graph
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run eager
            warnings.warn(f"--compile on: compiling the decode step failed "
                          f"({type(e).__name__}: {str(e)[:300]}); decode steps run eager",
                          stacklevel=2)
            return False
        if self.announce:
            print(f"braid: decode step compiled in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
        return True


@contextmanager
def dynamo_bytecode() -> Iterator[list[tuple[CodeType, CodeType]]]:
    """(original, generated) code objects of the frames dynamo compiles inside the block."""
    generated: list[tuple[CodeType, CodeType]] = []
    handle = torch._dynamo.convert_frame.register_bytecode_hook(
        lambda original, new: generated.append((original, new)))
    try:
        yield generated
    finally:
        handle.remove()


def generated_function(generated: list[tuple[CodeType, CodeType]],
                       function: Callable) -> Callable | None:
    """`function` as the code dynamo generated for it (it calls the compiled graph, from
    `function`'s module globals, where dynamo put it): None unless exactly one was generated."""
    codes = [new for original, new in generated if original is function.__code__]
    if len(codes) != 1 or codes[0].co_freevars:
        return None
    return FunctionType(codes[0], function.__globals__, function.__name__)


def warm_up_plans(block_size: int) -> list[StepPlan]:
    """Decode steps of each batch size class (one sequence; `WARM_UP_ROWS`, standing for
    several), each attending to two blocks' worth of keys (`DECODE_MIN_BLOCKS`: no decode step
    is narrower) and writing them into block 0 only (sequences may share a slot there)."""
    plans = []
    for batch in (1, WARM_UP_ROWS):
        kv_len = block_size + 1
        plans.append(StepPlan(
            input_ids=np.zeros(batch, dtype=np.int64),
            positions=np.full(batch, kv_len - 1, dtype=np.int64),
            slot_mapping=np.arange(batch, dtype=np.int64) % block_size,
            q_lens=np.ones(batch, dtype=np.int64),
            kv_lens=np.full(batch, kv_len, dtype=np.int64),
            block_tables=np.zeros((batch, DECODE_MIN_BLOCKS), dtype=np.int64),
            logit_rows=np.arange(batch, dtype=np.int64)))
    return plans
