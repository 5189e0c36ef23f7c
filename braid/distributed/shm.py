"""Shared-memory collectives for ranks on one host, split into post and wait.

One file in /dev/shm per launch holds, for every rank, a ring of slots. An operation gets the next
operation number k (every rank issues collectives in the same order, so k agrees across ranks)
and the next slot in round-robin order that this rank has not posted into and left unreleased.
Every rank posts and waits in the same program order, so every rank picks the same slot for k:

- `post`: wait until every rank has released the slot's previous use, copy this rank's data
  into its slot, then publish k in the slot's header. `all_reduce_into_async` reserves the slot
  first and lets the producer (a block's row-parallel GEMM) write its output there: no copy.
- `wait`: spin until every rank has published k, reduce (or gather) all ranks' slots into the
  output, then release the slot by writing k as this rank's consumed mark. `wait_add` sums the
  slots straight into the new residual. A gather to rank 0 (the logits) has the other ranks
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

Ordering relies on the host's total store order (x86): the data copy completes before the header
store that publishes it, and readers load the header before the data. Python has no portable
memory fences, so the backend refuses other architectures (`--comm auto` picks torch there).

The segment's memory is reserved when it is created (a sparse file in a small /dev/shm would
kill a rank with SIGBUS at first touch), and the file is unlinked as soon as every rank has
mapped it, so no crash of any process can leave it behind.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from braid.config import SHM_NEEDS_TSO, UserError, host_has_total_store_order
from braid.distributed.comm import Communicator, Handle
from braid.layers.fused import add_pair
from braid.overlap.trace import tracer

SHM_DIR_ENV = "BRAID_SHM_DIR"  # where segments go when not /dev/shm (another tmpfs)
SEGMENT_PREFIX = "braid-"
_HEADER_WORDS = 8  # int64 words per (rank, slot): one 64-byte cache line, no false sharing
_PUBLISHED, _CONSUMED = 0, 1
_MAPPED = 0  # control word (one cache line per rank, after the slot headers): 1 once mapped
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
        self._unlink_once_mapped()

    def _word(self, rank: int, slot: int, field: int) -> int:
        return (rank * self.segment.num_slots + slot) * _HEADER_WORDS + field

    def _control_word(self, rank: int, field: int) -> int:
        return (self.world_size * self.segment.num_slots + rank) * _HEADER_WORDS + field

    def _unlink_once_mapped(self) -> None:
        """Say this rank has mapped the segment; rank 0 waits for all, then removes the file
        (the mappings keep the memory), so no later crash can leak it."""
        self._header[self._control_word(self.rank, _MAPPED)] = 1
        if self.rank == 0:
            words = [self._control_word(r, _MAPPED) for r in range(self.world_size)]
            self._spin(words, 1, "map the shared memory segment")
            self.segment.unlink()

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

    def _reserve(self) -> tuple[int, int]:
        """The next operation number and this rank's slot for it, free on every rank."""
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
        self._spin(self._spin_words[_CONSUMED][slot], self._last_op[slot], f"release #{op}")
        self._slot_of[op] = slot
        self._held.add(slot)
        self._last_op[slot] = op
        self._last_slot = slot
        return op, slot

    def _publish(self, op: int) -> None:
        self._header[self._word(self.rank, self._slot_of[op], _PUBLISHED)] = op

    def _post(self, chunk: torch.Tensor) -> int:
        """Copy a chunk (at most a slot) into this rank's next slot and publish it."""
        op, slot = self._reserve()
        if chunk.numel():
            self._views(chunk.dtype, tuple(chunk.shape))[self.rank][slot].copy_(chunk)
        self._publish(op)
        return op

    def _arrived(self, op: int, dtype: torch.dtype,
                 shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """Wait for every rank's chunk of `op`; views of them (valid until `_release`)."""
        slot = self._slot_of[op]
        self._spin(self._spin_words[_PUBLISHED][slot], op, f"publish #{op}")
        return [self._views(dtype, shape)[r][slot] for r, shape in enumerate(shapes)]

    def _release(self, op: int) -> None:
        slot = self._slot_of.pop(op)
        self._held.discard(slot)
        self._header[self._word(self.rank, slot, _CONSUMED)] = op

    def _spin(self, words: list[int], value: int, what: str) -> None:
        """Until every rank's header `words` reach `value`; spin, then yield. On timeout the
        error names the ranks that did not `what`."""
        header = self._header
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
                raise ShmTimeout(
                    f"shm on rank {self.rank}: rank(s) {', '.join(map(str, missing))} did not "
                    f"{what} within {self.timeout_s:.0f} s")
            os.sched_yield() if spins < 4 * _SPINS_BEFORE_YIELD else time.sleep(50e-6)

    # --- collectives ---------------------------------------------------------------------------

    def _chunk_elems(self, dtype: torch.dtype) -> int:
        return self.segment.slot_bytes // dtype.itemsize

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self._fits(x.shape, x.dtype) and not tracer().enabled:
            # One slot, synchronous: the shortest path, for the many small reduces of decode.
            return self._sum_slot(self._post(x), x.shape, x.dtype)
        return super().all_reduce(x)

    def _fits(self, shape: Sequence[int], dtype: torch.dtype) -> bool:
        return math.prod(shape) * dtype.itemsize <= self.segment.slot_bytes

    def _sum_slot(self, op: int, shape: Sequence[int], dtype: torch.dtype,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
        """The sum over ranks of one posted slot-sized operation `op` (plus `residual`)."""
        out = _sum(self._arrived(op, dtype, [tuple(shape)] * self.world_size), residual)
        self._release(op)
        return out

    def _slot_handle(self, op: int, shape: Sequence[int], dtype: torch.dtype) -> Handle:
        return Handle(lambda: self._sum_slot(op, shape, dtype),
                      finish_add=lambda residual: self._sum_slot(op, shape, dtype, residual))

    def _start_all_reduce_into(self, shape: tuple[int, ...], dtype: torch.dtype,
                               produce: Callable[[torch.Tensor | None], torch.Tensor]) -> Handle:
        if not self._fits(shape, dtype):
            return super()._start_all_reduce_into(shape, dtype, produce)
        # Zero copy: the producer writes its partial straight into this rank's slot.
        op, slot = self._reserve()
        buffer = self._views(dtype, shape)[self.rank][slot]
        partial = produce(buffer)
        if partial.data_ptr() != buffer.data_ptr():  # a producer that could not write in place
            buffer.copy_(partial)
        self._publish(op)
        return self._slot_handle(op, shape, dtype)

    def _start_all_reduce(self, x: torch.Tensor) -> Handle:
        if self._fits(x.shape, x.dtype):
            return self._slot_handle(self._post(x), x.shape, x.dtype)
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
        chunks = self._gather_chunks(x, sizes)
        out = torch.empty((sum(sizes), *x.shape[1:]), dtype=x.dtype, device=x.device)
        first = self._post(chunks[0])
        return Handle(lambda: self._collect(first, chunks, x, sizes, out))

    def _gather_to_first(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        chunks = self._gather_chunks(x, sizes)
        out = (torch.empty((sum(sizes), *x.shape[1:]), dtype=x.dtype, device=x.device)
               if self.rank == 0 else None)
        return self._collect(self._post(chunks[0]), chunks, x, sizes, out)

    def _gather_chunks(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """This rank's slot-sized pieces of `x`. Every rank has as many as the largest
        contribution needs, so operation numbers stay aligned; a rank that has run out of data
        posts empty ones."""
        row = math.prod(x.shape[1:])
        step = self._chunk_elems(x.dtype)
        flat = x.contiguous().view(-1)
        num_chunks = max(1, -(-max(sizes) * row // step))
        return [flat[i * step:(i + 1) * step] for i in range(num_chunks)]

    def _collect(self, first: int, chunks: list[torch.Tensor], x: torch.Tensor,
                 sizes: list[int], out: torch.Tensor | None) -> torch.Tensor | None:
        """Post the chunks after the first one at a time and copy every rank's into `out`.
        Without `out` (rank > 0 of a gather to rank 0) each chunk is released once posted:
        rank 0's release still guards the slot's reuse."""
        row = math.prod(x.shape[1:])
        numels = [s * row for s in sizes]
        offsets = [sum(numels[:r]) for r in range(len(numels))]
        step = self._chunk_elems(x.dtype)
        out_flat = out.view(-1) if out is not None else None
        op = first
        for i, chunk in enumerate(chunks):
            if i:
                op = self._post(chunk)
            if out_flat is not None:
                lengths = [max(0, min(step, n - i * step)) for n in numels]
                parts = self._arrived(op, x.dtype, [(n,) for n in lengths])
                for r, part in enumerate(parts):
                    start = offsets[r] + i * step
                    out_flat[start:start + lengths[r]].copy_(part)
            self._release(op)
        return out

    def close(self) -> None:
        # Views into the map must go before the map can close. The file is gone already (rank 0
        # unlinks it once all have mapped it; the launcher's cleanup covers an early crash).
        self._header.release()
        self._header = self._slots = None
        self._view_cache.clear()
        try:
            self._mmap.close()
        except BufferError:  # a tensor still references the map; the OS frees it at exit
            pass


def _sum(parts: list[torch.Tensor], residual: torch.Tensor | None = None) -> torch.Tensor:
    """parts[0] + parts[1] + ... in rank order, then + residual, as a new tensor; 16-bit terms
    are summed in fp32 and rounded once (tp 2's block sums in one pass: `add_pair`). Every
    rank runs the same order, so all get the same bits."""
    if len(parts) == 2 and residual is not None:
        return add_pair(parts[0], parts[1], residual)
    terms = parts if residual is None else [*parts, residual]
    if len(terms) == 1:
        return terms[0].clone()
    if len(terms) == 2:  # 16-bit: added in fp32, rounded once
        return torch.add(terms[0], terms[1])
    if terms[0].dtype in (torch.float16, torch.bfloat16):
        acc = terms[0].float()
        for term in terms[1:]:
            acc.add_(term)
        return acc.to(terms[0].dtype)
    out = torch.add(terms[0], terms[1])
    for term in terms[2:]:
        out.add_(term)
    return out
