"""How tensor-parallel ranks divide heads, MLP columns and the vocabulary, evenly or not."""

from __future__ import annotations

from dataclasses import dataclass

from braid.config import UserError


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
    """The attention heads one rank owns: query heads and the KV heads they read."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def partition_heads(num_heads: int, num_kv_heads: int, tp: int) -> list[HeadShard]:
    """Assign heads to ranks contiguously, keeping each query head with its KV group.

    With tp <= num_kv_heads, KV heads are split (unevenly if need be) and each rank takes the query
    heads of its KV heads. With more ranks than KV heads, each rank holds one KV head (replicated on
    the ranks that share it) and those ranks split that head's query group. Raises `UserError` when
    no valid split exists (a rank would get no query head).
    """
    if num_heads % num_kv_heads:
        raise UserError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        shards = []
        for rank in range(tp):
            kv_start, kv_count = split_range(num_kv_heads, tp, rank)
            shards.append(HeadShard(kv_start * group, kv_count * group, kv_start, kv_count))
        return shards
    owner = [rank * num_kv_heads // tp for rank in range(tp)]
    shards = []
    for rank in range(tp):
        kv = owner[rank]
        sharing = [r for r in range(tp) if owner[r] == kv]
        if len(sharing) > group:
            raise UserError(
                f"--tp {tp} cannot split {num_heads} query heads over {num_kv_heads} KV heads: "
                f"{len(sharing)} ranks would share a group of {group} query heads; "
                f"use --tp of at most {num_heads}"
            )
        q_start, q_count = split_range(group, len(sharing), sharing.index(rank))
        shards.append(HeadShard(kv * group + q_start, q_count, kv, 1))
    return shards
