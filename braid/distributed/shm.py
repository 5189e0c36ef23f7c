"""Shared-memory collectives for ranks on one host, split into post and wait.

One file in /dev/shm per launch holds, for every rank, a ring of slots. An operation gets the next
operation number k (every rank issues collectives in the same order, so k agrees across ranks)
and the next slot in round-robin order that this rank has not posted into and left unreleased.
Every rank posts and waits in the same program order, so every rank picks the same slot for k:

- `post`: wait until every rank has released the slot's previous use, copy this rank's data
  into its slot, then publish k in the slot's header.
- `wait`: spin until every rank has published k, reduce (or gather) all ranks' slots into the
  output, then release the slot by writing k as this rank's consumed mark.

A slot still held by a posted, unwaited operation (the other micro-batch's all-reduce under
two-batch overlap) is never picked, so a collective chunked into more pieces than there are
slots cycles through the free ones instead of waiting for a slot only its own caller can
release (which deadlocked).

Between the two, the caller computes (two-batch overlap runs the other micro-batch there), so the
wait is usually free. Tensors larger than a slot go in chunks, one operation each. Reductions run
in rank order on every rank (bitwise-identical results everywhere), in fp32 for 16-bit inputs.

Ordering relies on the host's total store order (x86): the data copy completes before the header
store that publishes it, and readers load the header before the data.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from braid.distributed.comm import Communicator, Handle
from braid.overlap.trace import tracer

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "braid-"
_HEADER_WORDS = 8  # int64 words per (rank, slot): one 64-byte cache line, no false sharing
_PUBLISHED, _CONSUMED = 0, 1
_SPINS_BEFORE_YIELD = 2000


class ShmTimeout(RuntimeError):
    """A collective waited longer than the timeout for some ranks."""


@dataclass(frozen=True)
class ShmSegment:
    """Where a launch's shared memory lives and how it is laid out (picklable for the ranks)."""

    path: str
    world_size: int
    num_slots: int
    slot_bytes: int

    @property
    def header_bytes(self) -> int:
        return self.world_size * self.num_slots * _HEADER_WORDS * 8

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.world_size * self.num_slots * self.slot_bytes

    @staticmethod
    def create(world_size: int, num_slots: int = 8, slot_bytes: int = 4 << 20) -> ShmSegment:
        """Create a zeroed segment with a name unique to this launch."""
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"the shm backend needs {SHM_DIR}; use --comm torch")
        path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        segment = ShmSegment(path, world_size, num_slots, slot_bytes)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, segment.total_bytes)
        finally:
            os.close(fd)
        return segment

    def unlink(self) -> str:
        """Remove the file (idempotent); a line saying whether shared memory was cleaned."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            return f"shared memory {self.path} could not be removed: {e}"
        return f"shared memory {self.path} removed"


def activation_slot_bytes(max_tokens: int, hidden_size: int, itemsize: int) -> int:
    """A slot size that holds a whole step's activations (so an overlapped all-reduce is one
    posted operation, not chunks posted later), within [4 MiB, 64 MiB]. The file is sparse:
    memory is committed only as slots are used."""
    return int(min(64 << 20, max(4 << 20, max_tokens * hidden_size * itemsize)))


class ShmCommunicator(Communicator):
    """Split-phase all-reduce and all-gather through a `ShmSegment`."""

    def __init__(self, rank: int, segment: ShmSegment, timeout_s: float = 60.0) -> None:
        super().__init__(rank, segment.world_size)
        self.segment = segment
        self.timeout_s = timeout_s
        fd = os.open(segment.path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, segment.total_bytes)
        finally:
            os.close(fd)
        world, slots = segment.world_size, segment.num_slots
        # Header words read through a memoryview: ~20x cheaper per read than numpy indexing,
        # which matters in the spin loop and in every small collective.
        self._header = memoryview(self._mmap)[:segment.header_bytes].cast("q")
        data = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=segment.header_bytes,
                                count=world * slots * segment.slot_bytes)
        self._slots = data.view(world, slots, segment.slot_bytes)
        self._view_cache: dict[tuple[torch.dtype, int], list[list[torch.Tensor]]] = {}
        # Per field and slot, the header words of every rank (precomputed for the spin loop).
        self._spin_words = [[[self._word(r, slot, field) for r in range(world)]
                             for slot in range(slots)] for field in (_PUBLISHED, _CONSUMED)]
        self._next_op = 1
        self._slot_of: dict[int, int] = {}  # posted, unreleased operation -> its slot
        self._held: set[int] = set()  # their slots
        self._last_op = [0] * slots  # the latest operation each slot carried
        self._last_slot = slots - 1

    def _word(self, rank: int, slot: int, field: int) -> int:
        return (rank * self.segment.num_slots + slot) * _HEADER_WORDS + field

    def _views(self, dtype: torch.dtype, shape: tuple[int, ...]) -> list[list[torch.Tensor]]:
        """[rank][slot] views of the start of each slot as a `dtype` tensor of `shape`.

        Cached per (dtype, shape): making a view costs microseconds, a 4 KiB collective only
        tens, and decode repeats the same few shapes every step.
        """
        key = (dtype, shape)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) > 256:
                self._view_cache.clear()
            numel = math.prod(shape)
            views = [[self._slots[r, s].view(dtype)[:numel].view(shape)
                      for s in range(self.segment.num_slots)] for r in range(self.world_size)]
            self._view_cache[key] = views
        return views

    # --- one slot-sized operation -------------------------------------------------------------

    def _post(self, chunk: torch.Tensor) -> int:
        """Copy a chunk (at most a slot) into this rank's next slot and publish it."""
        op = self._next_op
        self._next_op += 1
        # Round robin over the slots, skipping held ones: a rank ahead of its peers can post
        # while they still read the slots of its previous operations.
        slot = self._last_slot
        for _ in range(self.segment.num_slots):
            slot = (slot + 1) % self.segment.num_slots
            if slot not in self._held:
                break
        else:
            raise RuntimeError(f"more than {self.segment.num_slots} shm collectives in flight")
        # The slot's previous use must be released everywhere.
        self._spin(slot, _CONSUMED, self._last_op[slot])
        self._slot_of[op] = slot
        self._held.add(slot)
        self._last_op[slot] = op
        self._last_slot = slot
        if chunk.numel():
            self._views(chunk.dtype, tuple(chunk.shape))[self.rank][slot].copy_(chunk)
        self._header[self._word(self.rank, slot, _PUBLISHED)] = op
        return op

    def _arrived(self, op: int, dtype: torch.dtype,
                 shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """Wait for every rank's chunk of `op`; views of them (valid until `_release`)."""
        slot = self._slot_of[op]
        self._spin(slot, _PUBLISHED, op)
        return [self._views(dtype, shape)[r][slot] for r, shape in enumerate(shapes)]

    def _release(self, op: int) -> None:
        slot = self._slot_of.pop(op)
        self._held.discard(slot)
        self._header[self._word(self.rank, slot, _CONSUMED)] = op

    def _spin(self, slot: int, field: int, value: int) -> None:
        """Until every rank's header field for `slot` reaches `value`; spin, then yield."""
        header = self._header
        words = self._spin_words[field][slot]
        spins = 0
        deadline = None
        while True:
            for word in words:
                if header[word] < value:
                    break
            else:
                return
            spins += 1
            if spins < _SPINS_BEFORE_YIELD:
                continue
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            elif time.monotonic() > deadline:
                missing = [r for r, w in enumerate(words) if header[w] < value]
                what = "publish" if field == _PUBLISHED else "release"
                raise ShmTimeout(
                    f"shm collective #{value} on rank {self.rank}: rank(s) "
                    f"{', '.join(map(str, missing))} did not {what} it "
                    f"within {self.timeout_s:.0f} s")
            os.sched_yield() if spins < 4 * _SPINS_BEFORE_YIELD else time.sleep(50e-6)

    # --- collectives ---------------------------------------------------------------------------

    def _chunk_elems(self, dtype: torch.dtype) -> int:
        return self.segment.slot_bytes // dtype.itemsize

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() * x.element_size() > self.segment.slot_bytes or tracer().enabled:
            return super().all_reduce(x)
        # One slot, synchronous: the shortest path, for the many small reduces of decode.
        return self._sum_slot(self._post(x), x)

    def _sum_slot(self, op: int, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of one posted slot-sized operation `op` shaped like `x`."""
        out = _sum(self._arrived(op, x.dtype, [tuple(x.shape)] * self.world_size))
        self._release(op)
        return out

    def _start_all_reduce(self, x: torch.Tensor) -> Handle:
        if x.numel() * x.element_size() <= self.segment.slot_bytes:
            op = self._post(x)
            return Handle(lambda: self._sum_slot(op, x))
        flat = x.contiguous().view(-1)
        step = self._chunk_elems(x.dtype)
        out = torch.empty_like(flat)
        first = self._post(flat[:step])

        def finish_chunks() -> torch.Tensor:
            op = first
            for start in range(0, flat.numel(), step):
                end = min(start + step, flat.numel())
                if start:  # later chunks: one slot each, posted once the earlier ones are done
                    op = self._post(flat[start:end])
                parts = self._arrived(op, x.dtype, [(end - start,)] * self.world_size)
                out[start:end] = _sum(parts)
                self._release(op)
            return out.view(x.shape)

        return Handle(finish_chunks)

    def _start_all_gather(self, x: torch.Tensor, sizes: list[int]) -> Handle:
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        numels = [s * row for s in sizes]
        flat = x.contiguous().view(-1)
        step = self._chunk_elems(x.dtype)
        # Every rank runs the same number of chunks (the largest contribution's), so operation
        # numbers stay aligned; a rank that has run out of data posts empty chunks.
        num_chunks = max(1, -(-max(numels) // step))
        out = torch.empty((sum(sizes), *x.shape[1:]), dtype=x.dtype, device=x.device)
        out_flat = out.view(-1)
        offsets = np.concatenate([[0], np.cumsum(numels)[:-1]])
        first = self._post(flat[0:step])

        def finish() -> torch.Tensor:
            op = first
            for i in range(num_chunks):
                if i:
                    op = self._post(flat[i * step:(i + 1) * step])
                lengths = [max(0, min(step, n - i * step)) for n in numels]
                parts = self._arrived(op, x.dtype, [(n,) for n in lengths])
                for r, part in enumerate(parts):
                    start = int(offsets[r]) + i * step
                    out_flat[start:start + lengths[r]].copy_(part)
                self._release(op)
            return out

        return Handle(finish)

    def close(self) -> None:
        # Views into the map must go before the map can close; the file is the launcher's.
        self._header.release()
        self._header = self._slots = None
        self._view_cache.clear()
        try:
            self._mmap.close()
        except BufferError:  # a tensor still references the map; the OS frees it at exit
            pass


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1] + ... in rank order, as a new tensor; 16-bit inputs accumulate in
    fp32."""
    if parts[0].dtype in (torch.float16, torch.bfloat16):
        acc = parts[0].float()
        for part in parts[1:]:
            acc.add_(part)
        return acc.to(parts[0].dtype)
    if len(parts) == 1:
        return parts[0].clone()
    out = torch.add(parts[0], parts[1])
    for part in parts[2:]:
        out.add_(part)
    return out
