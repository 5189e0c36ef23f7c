"""Compiled steps: the operation list run as inductor-compiled code, at any tp, with or without
two-batch overlap (`--compile`, CPU).

A step of a small model is mostly dispatch: at batch 1 SmolLM2-135M runs about 1,500 operators
per token, and outside the weight GEMVs the eager step spends most of its time calling them.
Compiled, the elementwise work between GEMMs is fused and the kernels are called from
generated code. Collectives are operators like any other (`braid.distributed.comm`), so a
graph holds the whole layer stack at tp 1, 2 or 3. Two kinds of compiled code:

- **The decode graph** (`CompiledDecodeStep`): a decode step (one new token per sequence, no
  overlap) as one graph of the whole operation list, called from inductor's C++ wrapper
  without dynamo's guards, one graph for one sequence (inductor specialises size 1, where
  the linear layers run `decode_kernel`'s GEMV) and one for several (batch and block-table
  width symbolic). Decode attention is `decode_kernel`'s operator over the paged cache.
- **Pieces** (`CompiledPieces`): every other step (prompts, chunks, mixed steps, two-batch
  overlap) runs its operation list with each run of operations between two attention calls
  (`between_pieces`) compiled, token counts symbolic. Weights are graph inputs, so the graph
  of a piece serves every layer (regional compilation: the runs of a 30-layer model are 3
  graphs, 4 under overlap, whose stages end at the yields); attention, which reads the step's
  per-sequence metadata, and the LM head over a step's varying logit rows run eager between
  them.

Neither freezes the weights into the graph: the decode graph is saved by dynamo's AOT compile
(`torch.compile(...).aot_compile`), which cannot save frozen graphs, under braid's cache
(`compiled/`, keyed by braid's code, torch, the model file, the rank and what shapes the graph;
inductor's own cache of the kernels lies beside it, `inductor/`), so a warm start loads the
graphs in seconds and compiles nothing. Packed oneDNN weights reach graphs by number
(`quant.packed_linear`). Measured figures: docs/performance.md, "Compiled steps".
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from braid.cache import cache_root, code_version, model_identity, replace_atomically
from braid.compiler import configure_compiler
from braid.config import EngineConfig
from braid.layers.forward_batch import DECODE_MIN_BLOCKS, ForwardBatch
from braid.overlap.operations import YIELD, execute, is_between_pieces, split_stages
from braid.platform import isa_flags
from braid.step import StepPlan

# The decode graph's kernels are called from generated C++, not Python (at batch 1 the Python
# wrapper's calls cost more than the kernels they run), except where the graph holds
# torch.distributed's functional collectives, which the C++ wrapper cannot call (their process
# group argument). Pieces keep the Python wrapper: a piece runs a few dozen kernels of a large
# step, and the C++ wrapper's compile took longer than its calls could save.
_CPP_WRAPPER = {"cpp_wrapper": True}
# The rows the graph for several sequences is traced at: a typical decode batch.
WARM_UP_ROWS = 16


def mark_static(model: nn.Module) -> None:
    """The sizes of the model's tensors that are not parameters (KV caches, GGML blocks,
    rotary tables) are fixed: as symbols they took part in duck sizing (a step's block-table
    width or batch equal to a cache size was unified with it, then pinned, and the next step
    recompiled), and freezing lost track of them."""
    for module in model.modules():
        for value in vars(module).values():
            for tensor in _tensors(value):
                torch._dynamo.mark_static(tensor)


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list):
        return [t for v in value for t in _tensors(v)]
    if hasattr(value, "__dataclass_fields__"):  # GGMLWeight
        return [t for v in vars(value).values() for t in _tensors(v)]
    return []


class CompiledDecodeStep:
    """`execute(operations, batch)` of a decode step as one saved, reloadable graph per shape
    class (one sequence, several), for the steps `handles` accepts. `cache_key` None
    (`--no-cache`): compiled at every start, never saved."""

    def __init__(self, model: nn.Module, cache_key: str | None, cpp_wrapper: bool = True) -> None:
        self.model = model
        self.cache_key = cache_key
        self.cpp_wrapper = cpp_wrapper
        self._graphs: dict[bool, Callable] = {}  # one sequence? -> compiled function

    @staticmethod
    def handles(batch: ForwardBatch) -> bool:
        """A decode step: one group of sequences, each with one new token, each a logit row
        (so the batch has no logits index)."""
        return (len(batch.attn_groups) == 1 and batch.attn_groups[0].meta.decode
                and batch.logits_index is None)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        return self._graphs[batch.num_tokens == 1](self.model, batch)

    @property
    def ready(self) -> bool:
        return len(self._graphs) == 2

    def prepare(self, batches: dict[bool, ForwardBatch]) -> tuple[int, int]:
        """Load each shape class's graph from the cache, or compile and save it, tracing the
        given example step (never run); (loaded, compiled) counts."""
        loaded = compiled = 0
        for one_sequence, batch in batches.items():
            path = self._path(one_sequence)
            graph = None if path is None else _load(path, self.model)
            if graph is None:
                graph = _aot_compile(_decode_logits, (self.model, batch), self.cpp_wrapper)
                if path is not None:
                    _save(graph, path, self.model)
                compiled += 1
            else:
                loaded += 1
            self._graphs[one_sequence] = graph
        return loaded, compiled

    def _path(self, one_sequence: bool) -> Path | None:
        if self.cache_key is None:
            return None
        return cache_root() / "compiled" / self.cache_key / (
            "decode-one.bin" if one_sequence else "decode-several.bin")

    def cached(self) -> bool:
        """Whether both graphs are in the cache (a warm start loads them in seconds)."""
        paths = [self._path(one) for one in (True, False)]
        return all(path is not None and path.is_file() for path in paths)


def _decode_logits(model: nn.Module, batch: ForwardBatch) -> torch.Tensor:
    """The function the decode graph is compiled from (dynamo's AOT compile saves it by its
    code, so it is a module-level function of its inputs only)."""
    return execute(model.operations(), batch)["logits"]


def _aot_compile(function: Callable, example: tuple, cpp_wrapper: bool) -> Callable:
    """`function` compiled for inputs like `example`, never run. Without guards: the graph is
    called only for steps of its shape class (`CompiledDecodeStep.handles`) of the model it was
    traced on, and a guard on the model's objects could not be saved (the shm communicator
    holds its mapping)."""
    configure_compiler()
    with torch._inductor.config.patch(_CPP_WRAPPER if cpp_wrapper else {}):
        compiler = torch.compile(function, fullgraph=True, dynamic=True,
                                 options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
        return compiler.aot_compile((example, {}))


def _save(graph, path: Path, model: nn.Module) -> None:
    """Written to a temporary name and renamed: concurrent ranks and launches never read half a
    file (a graph that cannot be written is only not cached)."""
    try:
        replace_atomically(path, lambda tmp: graph.save_compiled_function(
            str(tmp), external_data={"model": model}))
    except Exception as e:  # noqa: BLE001 - a graph that cannot be saved is only not cached
        warnings.warn(f"cannot save a compiled graph under {path.parent} "
                      f"({type(e).__name__}: {e})", stacklevel=3)


def _load(path: Path, model: nn.Module) -> Callable | None:
    """The saved graph, or None (missing; damaged or from another torch: removed, recompiled)."""
    if not path.is_file():
        return None
    configure_compiler()
    try:
        with open(path, "rb") as f:
            return torch.compiler.load_compiled_function(f, external_data={"model": model})
    except Exception as e:  # noqa: BLE001 - any damage to a saved graph means: compile it again
        warnings.warn(f"compiled graph {path} is unusable ({type(e).__name__}: "
                      f"{str(e)[:200]}); compiling it again", stacklevel=3)
        path.unlink(missing_ok=True)
        return None


class CompiledPieces:
    """The operation list with each run of operations between `between_pieces` ones replaced by
    one compiled call: `plain` ignores the yields (a step run straight), `staged` keeps them
    (two-batch overlap, whose stages end there). A run's graph is keyed by its operations'
    functions, so the runs of every layer share one (their modules are its inputs)."""

    def __init__(self, operations: Sequence) -> None:
        self._runners: dict[tuple, Callable] = {}
        self.plain = self._with_pieces([[op for op in operations if op is not YIELD]])
        self.staged = self._with_pieces(split_stages(operations), yields=True)

    def _with_pieces(self, stages: list[list], yields: bool = False) -> list:
        ops: list = []
        for stage in stages:
            run: list = []
            for op in [*stage, None]:
                if op is None or is_between_pieces(op):
                    if run:
                        ops.append(self._piece(run))
                    run = []
                    if op is not None:
                        ops.append(op)
                else:
                    run.append(op)
            if yields:
                ops.append(YIELD)
        return ops

    def _piece(self, run: list) -> Callable:
        functions = tuple(op.__func__ for op in run)
        modules = tuple(op.__self__ for op in run)
        runner = self._runners.get(functions)
        if runner is None:
            configure_compiler()
            runner = self._runners[functions] = torch.compile(_piece_runner(functions),
                                                              dynamic=True)

        def piece(state, batch) -> None:
            runner(modules, state, batch)

        piece.__name__ = "+".join(f.__name__ for f in functions)
        return piece

    @property
    def kinds(self) -> int:
        """Distinct pieces (each one graph, more where token counts cross a GEMM's limit)."""
        return len(self._runners)


def _piece_runner(functions: tuple[Callable, ...]) -> Callable:
    def run(modules: tuple, state, batch) -> None:
        for function, module in zip(functions, modules):
            function(module, state, batch)

    # A code object of its own: dynamo keeps its graphs per code object and checks their guards
    # in turn at every call, so kinds sharing one would check each other's first.
    run.__code__ = run.__code__.replace()
    return run


def warm_up_plans(block_size: int) -> dict[bool, StepPlan]:
    """Decode steps of each shape class (one sequence; `WARM_UP_ROWS`, standing for several),
    each attending to two blocks' worth of keys (`DECODE_MIN_BLOCKS`: no decode step is
    narrower) and writing them into block 0 only (never handed out; sequences may share a
    slot there)."""
    plans = {}
    for batch in (1, WARM_UP_ROWS):
        kv_len = block_size + 1
        plans[batch == 1] = StepPlan(
            input_ids=np.zeros(batch, dtype=np.int64),
            positions=np.full(batch, kv_len - 1, dtype=np.int64),
            slot_mapping=np.arange(batch, dtype=np.int64) % block_size,
            q_lens=np.ones(batch, dtype=np.int64),
            kv_lens=np.full(batch, kv_len, dtype=np.int64),
            block_tables=np.zeros((batch, DECODE_MIN_BLOCKS), dtype=np.int64),
            logit_rows=np.arange(batch, dtype=np.int64))
    return plans


def piece_warm_up_plans(block_size: int, tokens: Sequence[int]) -> list[StepPlan]:
    """Prompt steps of `tokens` each (one prompt each, writing block 0 only, its slots shared),
    whose pieces compile every graph a step of that many rows reads (a GEMM's packed weights
    apply up to `KernelPlan.packed_max_rows` rows); the last token's logits only."""
    return [StepPlan(input_ids=np.zeros(n, dtype=np.int64), positions=np.arange(n),
                     slot_mapping=np.arange(n, dtype=np.int64) % block_size,
                     q_lens=np.array([n]), kv_lens=np.array([n]),
                     block_tables=np.zeros((1, -(-n // block_size)), dtype=np.int64),
                     logit_rows=np.array([n - 1]))
            for n in tokens]


def graph_cache_key(engine: EngineConfig, model_path: str, rank: int, world_size: int,
                    packed: bool, kv_blocks: int) -> str:
    """What a saved graph depends on beyond its code: braid's code, torch, the host's ISA and
    threads, the model's files, the rank's place and every engine setting that shapes the
    graph (the KV cache's size is a constant of it)."""
    identity = {
        "braid": code_version(), "torch": torch.__version__,
        "isa": torch.backends.cpu.get_cpu_capability(), "flags": isa_flags(),
        "threads": torch.get_num_threads(), "model": model_identity(model_path),
        "rank": rank, "world_size": world_size, "comm": engine.parallel.comm,
        "dtype": engine.dtype, "kv_cache_dtype": engine.kv_cache.kv_cache_dtype,
        "quantization": engine.compile.quantization, "block_inputs": engine.compile.block_inputs,
        "block_size": engine.kv_cache.block_size, "kv_blocks": kv_blocks, "packed": packed,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def elapsed(start: float) -> str:
    """Seconds since `start` (a `time.perf_counter()`), for a progress line."""
    return f"{time.perf_counter() - start:.0f} s"
