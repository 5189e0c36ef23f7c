"""Shared-memory collectives for ranks on one host, split into post and wait.

One file in /dev/shm per launch holds, for every rank, a ring of slots. An operation gets the next
operation number k (every rank issues collectives in the same order, so k agrees across ranks)
and the next slot in round-robin order that this rank has not posted into and left unreleased.
Every rank posts and waits in the same program order, so every rank picks the same slot for k:

- `post`: wait until every rank has released the slot's previous use, copy this rank's data
  into its slot, then publish k in the slot's header.
- `wait`: spin until every rank has published k, reduce (or gather) all ranks' slots into the
  output, then release the slot by writing k as this rank's consumed mark. A block's sum takes the
  residual too and writes the new residual. A gather to rank 0 (the logits) has the other ranks
  release their chunk as soon as it is posted; rank 0's release still guards its reuse.

A slot still held by a posted, unwaited operation (the other micro-batch's all-reduce under
two-batch overlap) is never picked, so a collective chunked into more pieces than there are
slots cycles through the free ones instead of waiting for a slot only its own caller can
release (which deadlocked).

Between the two, the caller computes (two-batch overlap runs the other micro-batch there), so the
wait is usually free. Tensors larger than a slot go in chunks, one operation each. Reductions run
in rank order on every rank (bitwise-identical results everywhere); 16-bit sums, the residual
included, accumulate in fp32 and round once (`torch.distributed`'s backends round the sum over
ranks, then its addition to the residual).

Both halves are braid's C++ operators (`csrc/shm_ring.cpp`), so eager steps and compiled graphs
(which call them from inductor's C++ wrapper) share one implementation, and post and wait are tied
by a data dependency (the wait takes the post's ticket). Headers are published with release and
read with acquire ordering. The backend was written for x86's total store order and is only
offered there (`--comm auto` picks torch elsewhere).

The segment's memory is reserved when it is created (a sparse file in a small /dev/shm would
kill a rank with SIGBUS at first touch), and the file is unlinked as soon as every rank has
mapped it, so no crash of any process can leave it behind.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from braid import native
from braid.distributed.comm import Communicator, Pending
from braid.errors import UserError
from braid.platform import SHM_NEEDS_TSO, host_has_total_store_order

SHM_DIR_ENV = "BRAID_SHM_DIR"  # where segments go when not /dev/shm (another tmpfs)
SEGMENT_PREFIX = "braid-"
_HEADER_WORDS = 8  # int64 words per (rank, slot): one 64-byte cache line, no false sharing
_MAPPED = 0  # control word (one cache line per rank, after the slot headers): 1 once mapped


@dataclass(frozen=True)
class ShmSegment:
    """Where a launch's shared memory lives and how it is laid out (picklable for the ranks)."""

    path: str
    world_size: int
    num_slots: int
    slot_bytes: int

    @property
    def header_bytes(self) -> int:
        """Slot headers, then one control line per rank."""
        return self.world_size * (self.num_slots + 1) * _HEADER_WORDS * 8

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.world_size * self.num_slots * self.slot_bytes

    @staticmethod
    def create(world_size: int, num_slots: int = 8, slot_bytes: int = 4 << 20) -> ShmSegment:
        """Create a zeroed segment with a name unique to this launch, its memory reserved.

        Raises `UserError` when the architecture's memory order is not x86's or /dev/shm has
        not the room (the message says how much and what to do).
        """
        if not host_has_total_store_order():
            raise UserError(SHM_NEEDS_TSO)
        folder = shm_dir()
        if not os.path.isdir(folder):
            raise UserError(f"--comm shm needs {folder}, which this host lacks; use --comm torch")
        path = os.path.join(folder, f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        segment = ShmSegment(path, world_size, num_slots, slot_bytes)
        segment._check_room()
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, segment.total_bytes)
        except OSError as e:
            segment.unlink()
            if e.errno in (errno.ENOSPC, errno.EFBIG):
                raise UserError(segment._no_room(f"reserving it failed: {e.strerror}")) from None
            raise
        finally:
            os.close(fd)
        return segment

    def _check_room(self) -> None:
        stat = os.statvfs(os.path.dirname(self.path))
        free = stat.f_bavail * stat.f_frsize
        if free < self.total_bytes:
            raise UserError(self._no_room(f"{free / 2**20:.0f} MiB are free"))

    def _no_room(self, why: str) -> str:
        folder = os.path.dirname(self.path)
        return (f"--comm shm needs {self.total_bytes / 2**20:.0f} MiB in {folder} for "
                f"{self.world_size} ranks, and {why}; use --comm torch, or give {folder} more "
                f"room (docker run --shm-size=1g), or point {SHM_DIR_ENV} at a larger tmpfs, "
                "or lower --max-num-batched-tokens (slots hold a step's activations)")

    def unlink(self) -> str:
        """Remove the file (idempotent); a line saying whether shared memory was cleaned."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            return f"shared memory {self.path} could not be removed: {e}"
        return f"shared memory {self.path} removed"


def shm_dir() -> str:
    """The folder segments are created in: $BRAID_SHM_DIR, else /dev/shm."""
    return os.environ.get(SHM_DIR_ENV) or "/dev/shm"


def activation_slot_bytes(max_tokens: int, hidden_size: int, itemsize: int) -> int:
    """A slot size that holds a whole step's activations (so an overlapped all-reduce is one
    posted operation, not chunks posted later), within [4 MiB, 64 MiB]. The memory is reserved
    when the segment is created."""
    return int(min(64 << 20, max(4 << 20, max_tokens * hidden_size * itemsize)))


class ShmCommunicator(Communicator):
    """Split-phase all-reduce and all-gather through a `ShmSegment`, by braid's C++ operators
    (`csrc/shm_ring.cpp`: `shm_post`, `shm_all_reduce`, `shm_all_gather`), which compiled
    graphs call too."""

    def __init__(self, rank: int, segment: ShmSegment, timeout_s: float) -> None:
        super().__init__(rank, segment.world_size)
        if not native.load():
            raise UserError("--comm shm needs braid's C++ operators, which could not be built "
                            "(see the warning above); use --comm torch")
        self.segment = segment
        self.timeout_s = timeout_s
        fd = os.open(segment.path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, segment.total_bytes)
        finally:
            os.close(fd)
        # The control words are read through a memoryview; the operators address the map.
        self._header = memoryview(self._mmap)[:segment.header_bytes].cast("q")
        self._memory = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.ring = torch.ops.braid.shm_open(self._memory.data_ptr(), segment.world_size, rank,
                                             segment.num_slots, segment.slot_bytes, timeout_s)
        # The ring's latest operation, which every operator writes: the chain of mutations that
        # keeps compiled collectives in order (see csrc/shm_ring.cpp)
        self.sequence = torch.zeros(1, dtype=torch.int64)
        self._unlink_once_mapped()

    def _control_word(self, rank: int) -> int:
        return (self.world_size * self.segment.num_slots + rank) * _HEADER_WORDS + _MAPPED

    def _unlink_once_mapped(self) -> None:
        """Say this rank has mapped the segment; rank 0 waits for all, then removes the file
        (the mappings keep the memory), so no later crash can leak it."""
        self._header[self._control_word(self.rank)] = 1
        if self.rank == 0:
            deadline = time.monotonic() + self.timeout_s
            while any(self._header[self._control_word(r)] < 1 for r in range(self.world_size)):
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size)
                               if self._header[self._control_word(r)] < 1]
                    raise RuntimeError(
                        f"shm on rank 0: rank(s) {', '.join(map(str, missing))} did not map "
                        f"the shared memory segment within {self.timeout_s:.0f} s")
                time.sleep(1e-3)
            self.segment.unlink()

    # Pending operations are (ticket, input): the wait reads the chunks the post could not fit.

    def _post(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.braid.shm_post(x, self.sequence, self.ring)

    def _post_reduce(self, x: torch.Tensor) -> Pending:
        return self._post(x), x

    def _finish_reduce(self, pending: Pending, residual: torch.Tensor | None) -> torch.Tensor:
        ticket, x = pending
        if residual is not None:
            residual = residual.contiguous()
        return torch.ops.braid.shm_all_reduce(ticket, x, residual, self.sequence, self.ring)

    _post_gather = _post_reduce

    def _finish_gather(self, pending: Pending) -> torch.Tensor:
        ticket, x = pending
        return self._gather(ticket, x, [x.shape[0]] * self.world_size, True)

    def _gather(self, ticket: torch.Tensor, x: torch.Tensor, sizes: list[int],
                collect: bool) -> torch.Tensor:
        return torch.ops.braid.shm_all_gather(ticket, x, sizes, collect, self.sequence, self.ring)

    def _all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return self._gather(self._post(x), x, sizes, True)

    def _gather_to_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        first = self.rank == 0  # the others post and release, and get an empty tensor
        out = self._gather(self._post(x), x, sizes, first)
        return out if first else None

    @contextmanager
    def long_timeout(self, seconds: float) -> Iterator[None]:
        torch.ops.braid.shm_set_timeout(self.ring, seconds)
        try:
            yield
        finally:
            torch.ops.braid.shm_set_timeout(self.ring, self.timeout_s)

    def close(self) -> None:
        # Views into the map must go before the map can close. The file is gone already (rank 0
        # unlinks it once all have mapped it; the launcher's cleanup covers an early crash).
        if self._memory is None:
            return
        torch.ops.braid.shm_close(self.ring)
        self._header.release()
        self._header = self._memory = None
        try:
            self._mmap.close()
        except BufferError:  # a tensor still references the map; the OS frees it at exit
            pass
