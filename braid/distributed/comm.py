"""Communicator: the collectives tensor parallelism needs, each with a sync and an async form.

Model code only sees this interface, so a backend (torch.distributed, shared memory, a no-op for
timing) is chosen at launch without touching layers. Async forms return a `Handle` whose `wait()`
returns the result; two-batch overlap launches a collective, yields, and waits later.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from braid.overlap.trace import tracer


class Handle:
    """A collective in flight; `wait()` blocks until it completes and returns its result, or
    `wait_add(residual)` returns the result plus `residual`. A handle is finished once.

    `finish_add`, where a backend gives one, produces the sum with the residual straight from
    its buffers (one pass fewer than summing and then adding).
    """

    def __init__(self, finish: Callable[[], torch.Tensor], name: str = "collective",
                 finish_add: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self._finish = finish
        self._finish_add = finish_add
        self._result: torch.Tensor | None = None
        self._added = False
        self.name = name

    def wait(self) -> torch.Tensor:
        if self._added:
            raise RuntimeError(f"{self.name}: already finished by wait_add")
        if self._result is None:
            with tracer().span(f"wait {self.name}", "comm"):
                self._result = self._finish()
        return self._result

    def wait_add(self, residual: torch.Tensor | None) -> torch.Tensor:
        """The result plus `residual` (the result alone when it is None)."""
        if residual is None or self._finish_add is None or self._result is not None:
            return self.wait() if residual is None else self.wait() + residual
        if self._added:
            raise RuntimeError(f"{self.name}: already finished by wait_add")
        self._added = True
        with tracer().span(f"wait {self.name}", "comm"):
            return self._finish_add(residual)


class Communicator(ABC):
    """Collectives across the ranks of one tensor-parallel group.

    Backends implement `_start_all_reduce` and `_start_all_gather` (launch, return a Handle);
    the public methods add tracing and the one-rank shortcut.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @abstractmethod
    def _start_all_reduce(self, x: torch.Tensor) -> Handle:
        """Start a sum over ranks of `x` (may reuse `x`'s storage for the result)."""

    @abstractmethod
    def _start_all_gather(self, x: torch.Tensor, sizes: list[int]) -> Handle:
        """Start concatenating every rank's `x` along dim 0 (rank r contributes sizes[r] rows)."""

    def _start_all_reduce_into(self, shape: tuple[int, ...], dtype: torch.dtype,
                               produce: Callable[[torch.Tensor | None], torch.Tensor]) -> Handle:
        """`all_reduce_into_async` for backends without a send buffer: produce, then reduce."""
        return self._start_all_reduce(produce(None))

    def all_reduce_async(self, x: torch.Tensor) -> Handle:
        """Start a sum over ranks; `wait()` on the handle returns it."""
        if self.world_size == 1:
            return Handle(lambda: x)
        tracer().instant("launch all_reduce", "comm")
        handle = self._start_all_reduce(x)
        handle.name = "all_reduce"
        return handle

    def all_reduce_into_async(self, shape: Sequence[int], dtype: torch.dtype,
                              produce: Callable[[torch.Tensor | None], torch.Tensor]) -> Handle:
        """Start a sum over ranks of the `shape`/`dtype` tensor `produce(out)` returns.

        `out` is the backend's send buffer (or None): a producer that writes its result into
        it (a GEMM's `out=`) spares the copy into shared memory. It must return the tensor it
        wrote, or a new one when it could not use `out`.
        """
        shape = tuple(shape)
        if self.world_size == 1:
            result = produce(None)
            return Handle(lambda: result)
        tracer().instant("launch all_reduce", "comm")
        handle = self._start_all_reduce_into(shape, dtype, produce)
        handle.name = "all_reduce"
        return handle

    def all_gather_async(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> Handle:
        """Start concatenating every rank's `x` along dim 0.

        `sizes[r]` is rank r's length along dim 0 when ranks contribute unequal lengths; the
        other dims must match on every rank.
        """
        if self.world_size == 1:
            return Handle(lambda: x)
        sizes = list(sizes) if sizes is not None else [x.shape[0]] * self.world_size
        tracer().instant("launch all_gather", "comm")
        handle = self._start_all_gather(x, sizes)
        handle.name = "all_gather"
        return handle

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_async(x).wait()

    def gather_to_first(self, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor | None:
        """Every rank's `x` concatenated along dim 0 on rank 0 (rank r contributes sizes[r]
        rows); None on the other ranks, which need not wait for the copy."""
        if self.world_size == 1:
            return x
        gathered = self._gather_to_first(x, list(sizes))
        return gathered if self.rank == 0 else None

    def _gather_to_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Backends without a rooted gather: everyone gathers."""
        return self._start_all_gather(x, sizes).wait()

    def all_gather(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> torch.Tensor:
        return self.all_gather_async(x, sizes).wait()

    def close(self) -> None:
        """Release backend resources (idempotent)."""


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    padded = x.new_zeros((rows, *x.shape[1:]))
    padded[: x.shape[0]] = x
    return padded


def _unpad_gathered(out: torch.Tensor, sizes: Sequence[int], rows: int) -> torch.Tensor:
    if all(s == rows for s in sizes):
        return out
    chunks = out.view(len(sizes), rows, *out.shape[1:])
    return torch.cat([chunks[r, :s] for r, s in enumerate(sizes)])


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchCommunicator(Communicator):
    """Collectives through `torch.distributed` (gloo on CPU, NCCL on CUDA).

    On CUDA an async collective runs on a dedicated communication stream: it starts once the
    compute stream has produced its input (stream wait), and `wait()` makes the compute stream
    wait for it, so the next micro-batch's kernels queue up while it is in flight.
    """

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(rank, world_size)
        self.group = group
        self._comm_stream = None

    def _launch(self, x: torch.Tensor, start: Callable[[], object],
                result: Callable[[], torch.Tensor]) -> Handle:
        if not x.is_cuda:
            work = start()
            return Handle(lambda: (work.wait(), result())[1])
        compute = torch.cuda.current_stream(x.device)
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(x.device)
        stream = self._comm_stream
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            work = start()
        x.record_stream(stream)  # keep the input alive until the collective has read it

        def finish() -> torch.Tensor:
            with torch.cuda.stream(stream):
                work.wait()
            compute.wait_stream(stream)
            return result()

        return Handle(finish)

    def _start_all_reduce(self, x: torch.Tensor) -> Handle:
        x = x.contiguous()
        return self._launch(x, lambda: dist.all_reduce(x, group=self.group, async_op=True),
                            lambda: x)

    def _start_all_gather(self, x: torch.Tensor, sizes: list[int]) -> Handle:
        rows = max(sizes)
        local = _pad_rows(x, rows)
        out = local.new_empty((rows * self.world_size, *x.shape[1:]))
        return self._launch(
            local, lambda: _all_gather_single(out, local, group=self.group, async_op=True),
            lambda: _unpad_gathered(out, sizes, rows))

    def _gather_to_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        rows = max(sizes)
        local = _pad_rows(x, rows)
        parts = [torch.empty_like(local) for _ in sizes] if self.rank == 0 else None
        first = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather(local, parts, dst=first, group=self.group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)]) if parts else None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class SkipCommunicator(Communicator):
    """Collectives replaced by no-ops (`--skip-comm`): results are wrong, timings show compute only.

    Shapes stay right so the model runs end to end: a reduce returns the local tensor, a gather
    tiles it to the gathered size.
    """

    def _start_all_reduce(self, x: torch.Tensor) -> Handle:
        return Handle(lambda: x)

    def _start_all_gather(self, x: torch.Tensor, sizes: list[int]) -> Handle:
        total = sum(sizes)
        reps = -(-total // max(x.shape[0], 1))
        return Handle(lambda: x.repeat(reps, *([1] * (x.dim() - 1)))[:total])


class SwitchableCommunicator(Communicator):
    """Delegates to the real backend, or to `SkipCommunicator` while `skip` is set.

    Lets one launch measure a step with and without communication (exposed communication).
    """

    def __init__(self, real: Communicator, skip: bool = False) -> None:
        super().__init__(real.rank, real.world_size)
        self.real = real
        self.skipping = SkipCommunicator(real.rank, real.world_size)
        self.skip = skip

    def _backend(self) -> Communicator:
        return self.skipping if self.skip else self.real

    def _start_all_reduce(self, x: torch.Tensor) -> Handle:
        return self._backend()._start_all_reduce(x)

    def _start_all_gather(self, x: torch.Tensor, sizes: list[int]) -> Handle:
        return self._backend()._start_all_gather(x, sizes)

    def _start_all_reduce_into(self, shape: tuple[int, ...], dtype: torch.dtype,
                               produce: Callable[[torch.Tensor | None], torch.Tensor]) -> Handle:
        return self._backend()._start_all_reduce_into(shape, dtype, produce)

    def _gather_to_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        return self._backend()._gather_to_first(x, sizes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skip else self.real.all_reduce(x)

    def close(self) -> None:
        self.real.close()
