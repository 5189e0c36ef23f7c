"""How tensor-parallel ranks divide heads, MLP columns and the vocabulary, evenly or not."""

from __future__ import annotations

from dataclasses import dataclass, replace

from braid.errors import UserError


def split_sizes(total: int, parts: int) -> list[int]:
    """Contiguous split of `total` into `parts`; the first `total % parts` parts get one extra."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` of `split_sizes(total, parts)`."""
    sizes = split_sizes(total, parts)
    return sum(sizes[:index]), sizes[index]


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns: a contiguous range of query heads and the KV heads
    they read (a KV head whose group is cut between ranks is held by each of them).

    Where such shared KV heads are split over sequences (`kv_parts`, see `partition_heads`),
    the rank holds the projections of every query head of its KV heads (`held`), attends its
    own query heads in prefill, and at decode attends each KV head's whole group over its part
    of the step's sequences, so that a shared KV head's cache is read once, not by every rank
    that holds it."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int
    group_size: int  # query heads per KV head in the model
    # Per local KV head: (this rank's part, parts) of the decode rows it attends that KV head
    # over ((0, 1): all of them); empty where shared KV heads are not split over sequences
    kv_parts: tuple[tuple[int, int], ...] = ()

    @property
    def held(self) -> tuple[int, int]:
        """(first, count) of the query heads whose projections the rank holds: its own, or
        every query head of its KV heads where shared KV heads are split over sequences."""
        if not self.kv_parts:
            return self.q_start, self.q_count
        return self.kv_start * self.group_size, self.kv_count * self.group_size

    @property
    def own_offset(self) -> int:
        """Where the rank's own query heads start among its `held` ones."""
        return self.q_start - self.held[0]

    def runs(self) -> list[tuple[int, int, int, int]]:
        """(first query head, query heads, first KV head, KV heads), local to this rank's own
        query heads: runs of KV heads that each serve the same number of them, so attention
        is one grouped-query call per run (a single run when the split keeps groups whole)."""
        runs: list[list[int]] = []
        q_end = self.q_start + self.q_count
        for j in range(self.kv_count):
            kv = self.kv_start + j
            served = (min(q_end, (kv + 1) * self.group_size)
                      - max(self.q_start, kv * self.group_size))
            if runs and runs[-1][1] == served * runs[-1][3]:
                runs[-1][1] += served
                runs[-1][3] += 1
            else:
                q_local = sum(run[1] for run in runs)
                runs.append([q_local, served, j, 1])
        return [tuple(run) for run in runs]


def partition_heads(num_heads: int, num_kv_heads: int, tp: int) -> list[HeadShard]:
    """Split the query heads over ranks as evenly as possible (contiguously, remainders
    first); each rank holds the KV heads its query heads read.

    An even query split balances the attention block, which every rank finishes before the
    same all-reduce: SmolLM2's 9 heads in 3 KV groups split 5/4 at tp 2 (the middle KV head on
    both ranks), where whole groups would split 6/3 and leave rank 1 idle a third of the
    block. A KV head on several ranks would have its cache read by each of them at every
    decode step; `_split_shared_over_sequences` says when its readers divide the sequences
    instead. Raises `UserError` when a rank would get no query head.
    """
    if num_heads % num_kv_heads:
        raise UserError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if tp > num_heads:
        raise UserError(f"--tp {tp} cannot split {num_heads} query heads: a rank would get none; "
                        f"use --tp of at most {num_heads}")
    group = num_heads // num_kv_heads
    shards = []
    for rank in range(tp):
        q_start, q_count = split_range(num_heads, tp, rank)
        kv_start = q_start // group
        kv_end = (q_start + q_count - 1) // group + 1
        shards.append(HeadShard(q_start, q_count, kv_start, kv_end - kv_start, group))
    return _split_shared_over_sequences(shards, num_kv_heads)


def _split_shared_over_sequences(shards: list[HeadShard], num_kv_heads: int) -> list[HeadShard]:
    """`shards` with their `kv_parts` set where the split cut some KV head's group and the
    trade pays on its face: every rank still holds a KV head of its own (a rank whose only KV
    heads are shared would hold whole groups' projections, up to the model's every head, to
    save part of one KV head's reads) and no rank holds a whole group of query heads more than
    its own. SmolLM2 at tp 2 qualifies: each rank then reads one and a half KV heads at decode,
    not two, for one or two more heads of Q and O projection."""
    readers: list[list[int]] = [[] for _ in range(num_kv_heads)]
    for rank, s in enumerate(shards):
        for kv in range(s.kv_start, s.kv_start + s.kv_count):
            readers[kv].append(rank)
    if all(len(r) == 1 for r in readers):
        return shards
    for rank, s in enumerate(shards):
        own = any(readers[kv] == [rank] for kv in range(s.kv_start, s.kv_start + s.kv_count))
        if not own or s.kv_count * s.group_size - s.q_count >= s.group_size:
            return shards
    return [replace(s, kv_parts=tuple((readers[kv].index(rank), len(readers[kv]))
                                      for kv in range(s.kv_start, s.kv_start + s.kv_count)))
            for rank, s in enumerate(shards)]
