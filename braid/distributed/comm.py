"""Communicator: the collectives tensor parallelism needs, each with a sync and an async form.

Model code only sees this interface, so a backend (shared memory, torch.distributed, a no-op for
timing) is chosen at launch without touching layers. An async form returns a `Pending`: a tuple
of tensors that only its backend reads (the input and, over shared memory, the post's ticket).
`wait_sum` / `wait_gather` finish it. Being tensors, a collective in flight lives in a
micro-batch's state like any activation and crosses compiled graphs' boundaries: two-batch
overlap launches a collective, yields, and waits later, compiled or not.

Every backend's collectives are operators a compiler keeps in its graph: braid's C++ operators
over shared memory (`braid.distributed.shm`), `torch.distributed`'s functional collectives
(`_c10d_functional`, whose wait is an operator on the result) for gloo and NCCL. A wait takes
what its post returned, so no compiler can move it first or drop either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from braid.distributed import compression
from braid.trace import tracer

Pending = tuple[torch.Tensor, ...]


class Communicator(ABC):
    """Collectives across the ranks of one tensor-parallel group.

    Backends implement the `_post_*` / `_finish_*` pairs and `_all_gather` (`_gather_to_first`
    defaults to a gather that every rank but the first discards); the public
    methods add tracing and the one-rank shortcut (no copy, nothing to wait for).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @abstractmethod
    def _post_reduce(self, x: torch.Tensor) -> Pending:
        """Start a sum over ranks of `x`."""

    @abstractmethod
    def _finish_reduce(self, pending: Pending, residual: torch.Tensor | None) -> torch.Tensor:
        """The sum (plus `residual`, where given) of a started reduce."""

    @abstractmethod
    def _post_gather(self, x: torch.Tensor) -> Pending:
        """Start concatenating every rank's `x` (the same shape on every rank) along dim 0."""

    @abstractmethod
    def _finish_gather(self, pending: Pending) -> torch.Tensor:
        """The concatenation of a started gather."""

    @abstractmethod
    def _all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's `x` concatenated along dim 0, rank r contributing sizes[r] rows."""

    def _gather_to_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """`_all_gather` on rank 0; backends without a rooted gather gather everywhere."""
        gathered = self._all_gather(x, sizes)
        return gathered if self.rank == 0 else None

    def all_reduce_async(self, x: torch.Tensor) -> Pending:
        """Start a sum over ranks; `wait_sum` returns it."""
        if self.world_size == 1:
            return (x,)
        tracer().instant("launch all_reduce", "comm")
        return self._post_reduce(x.contiguous())

    def wait_sum(self, pending: Pending, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The sum over ranks that `pending` started, plus `residual` where given (over shared
        memory summed from the ranks' slots into the residual in one pass)."""
        if self.world_size == 1:
            return pending[0] if residual is None else pending[0] + residual
        with tracer().span("wait all_reduce", "comm"):
            return self._finish_reduce(pending, residual)

    def all_gather_async(self, x: torch.Tensor) -> Pending:
        """Start concatenating every rank's `x`, the same shape on every rank, along dim 0;
        `wait_gather` returns it."""
        if self.world_size == 1:
            return (x,)
        tracer().instant("launch all_gather", "comm")
        return self._post_gather(x.contiguous())

    def wait_gather(self, pending: Pending) -> torch.Tensor:
        if self.world_size == 1:
            return pending[0]
        with tracer().span("wait all_gather", "comm"):
            return self._finish_gather(pending)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.wait_sum(self.all_reduce_async(x))

    def all_gather(self, x: torch.Tensor, sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Every rank's `x` concatenated along dim 0; `sizes[r]` is rank r's length along dim 0
        when ranks contribute unequal lengths (the other dims must match)."""
        if self.world_size == 1:
            return x
        if sizes is None:
            return self.wait_gather(self.all_gather_async(x))
        return self._all_gather(x.contiguous(), list(sizes))

    def gather_to_first(self, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor | None:
        """Every rank's `x` concatenated along dim 0 on rank 0 (rank r contributes sizes[r]
        rows); None on the other ranks, which need not wait for the copy."""
        if self.world_size == 1:
            return x
        return self._gather_to_first(x.contiguous(), list(sizes))

    @contextmanager
    def long_timeout(self, seconds: float) -> Iterator[None]:
        """Collectives inside may wait up to `seconds` for the other ranks (while each compiles
        the same code at its own pace); backends with a fixed, long timeout ignore it."""
        yield

    def close(self) -> None:
        """Release backend resources (idempotent)."""


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    padded = x.new_zeros((rows, *x.shape[1:]))
    padded[: x.shape[0]] = x
    return padded


def _unpad_gathered(out: torch.Tensor, sizes: Sequence[int], rows: int) -> torch.Tensor:
    if all(s == rows for s in sizes):
        return out
    chunks = out.view(len(sizes), rows, *out.shape[1:])
    return torch.cat([chunks[r, :s] for r, s in enumerate(sizes)])


class TorchCommunicator(Communicator):
    """Collectives through `torch.distributed`'s functional collectives (gloo on CPU, NCCL on
    CUDA), which compiled graphs keep as operators. On CUDA NCCL runs them on its own stream;
    the wait makes the compute stream wait for it, so the other micro-batch's kernels queue up
    while one is in flight."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(rank, world_size)
        self.group_name = (group or dist.group.WORLD).group_name

    def _post_reduce(self, x: torch.Tensor) -> Pending:
        return (torch.ops._c10d_functional.all_reduce(x, "sum", self.group_name),)

    def _finish_reduce(self, pending: Pending, residual: torch.Tensor | None) -> torch.Tensor:
        total = torch.ops._c10d_functional.wait_tensor(pending[0])
        return total if residual is None else total + residual

    def _post_gather(self, x: torch.Tensor) -> Pending:
        # The out= form, not all_gather_into_tensor: on gloo that one runs as an
        # ALLGATHER_COALESCED work, and torch 2.13's gloo frees the heap buffer of that long
        # name from each worker thread that finishes one, unlocked: two gathers in flight
        # corrupt the heap (docs/gloo-race.md). This one runs as _allgather_base, whose name
        # fits std::string's inline buffer.
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        return (torch.ops._c10d_functional.all_gather_into_tensor_out(
            x, self.world_size, self.group_name, out=out),)

    def _finish_gather(self, pending: Pending) -> torch.Tensor:
        return torch.ops._c10d_functional.wait_tensor(pending[0])

    def _all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        rows = max(sizes)  # all_gather_into_tensor takes equal parts: pad, then drop the padding
        gathered = self._finish_gather(self._post_gather(_pad_rows(x, rows)))
        return _unpad_gathered(gathered, sizes, rows)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class SkipCommunicator(Communicator):
    """Collectives replaced by no-ops (`--skip-comm`): results are wrong, timings show compute only.

    Shapes stay right so the model runs end to end: a reduce returns the local tensor, a gather
    tiles it to the gathered size.
    """

    def _post_reduce(self, x: torch.Tensor) -> Pending:
        return (x,)

    def _finish_reduce(self, pending: Pending, residual: torch.Tensor | None) -> torch.Tensor:
        return pending[0] if residual is None else pending[0] + residual

    def _post_gather(self, x: torch.Tensor) -> Pending:
        return (x,)

    def _finish_gather(self, pending: Pending) -> torch.Tensor:
        return self._tiled(pending[0], pending[0].shape[0] * self.world_size)

    def _all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return self._tiled(x, sum(sizes))

    @staticmethod
    def _tiled(x: torch.Tensor, rows: int) -> torch.Tensor:
        reps = -(-rows // max(x.shape[0], 1))
        return x.repeat(reps, *([1] * (x.dim() - 1)))[:rows]


class SwitchableCommunicator(Communicator):
    """Delegates to the real backend, or to `SkipCommunicator` while `skip` is set; sums
    travel compressed (`braid.distributed.compression`) while `compression` is not "none".

    Lets one launch measure a step with and without communication (exposed communication), and
    the engine choose compression per step; both change between steps only, never while a
    collective is in flight.
    """

    def __init__(self, real: Communicator, skip: bool = False) -> None:
        super().__init__(real.rank, real.world_size)
        self.real = real
        self.skipping = SkipCommunicator(real.rank, real.world_size)
        self.skip = skip
        self.compression = "none"

    def _backend(self) -> Communicator:
        return self.skipping if self.skip else self.real

    def _post_reduce(self, x: torch.Tensor) -> Pending:
        if self.compression == "none" or self.skip:
            return self._backend()._post_reduce(x)
        # The partial sum itself rides along: its shape and dtype say how to unpack.
        return (*self.real._post_gather(compression.pack(x, self.compression)), x)

    def _finish_reduce(self, pending: Pending, residual: torch.Tensor | None) -> torch.Tensor:
        if self.compression == "none" or self.skip:
            return self._backend()._finish_reduce(pending, residual)
        *posted, partial = pending
        return compression.unpack_sum(self.real._finish_gather(tuple(posted)),
                                      self.compression, self.world_size, partial, residual)

    def _post_gather(self, x: torch.Tensor) -> Pending:
        return self._backend()._post_gather(x)

    def _finish_gather(self, pending: Pending) -> torch.Tensor:
        return self._backend()._finish_gather(pending)

    def _all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return self._backend()._all_gather(x, sizes)

    def _gather_to_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        return self._backend()._gather_to_first(x, sizes)

    def long_timeout(self, seconds: float):
        return self.real.long_timeout(seconds)

    def close(self) -> None:
        self.real.close()
