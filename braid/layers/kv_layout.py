"""How a layer's KV cache tensors lay out its tokens' rows, and the code that indexes them:
allocation, writes at slots, reads of whole blocks.

Three layouts, each indexed by block, then slot within the block:

- `TOKEN_MAJOR` (prompt steps, GPUs): `[num_blocks, block_size, heads, head_dim]`, contiguous.
- `TOKENS_INNERMOST` (decode steps that read the cache through `decode_kernel`'s operator, or
  compile): views of that shape over keys stored `[heads, blocks, head_dim, block_size]` and
  values stored `[heads, blocks, block_size, head_dim]`.
- `PAIRS` (an int8 cache read by the operator on a CPU with AVX512-VNNI, a bf16 one on a CPU
  with AVX512-BF16): as `TOKENS_INNERMOST`, but keys keep two head dims of a token side by
  side (`[heads, blocks, head_dim / 2, block_size, 2]`) and values two tokens of a dimension
  (`[heads, blocks, block_size / 2, head_dim, 2]`), so that one dot-product instruction
  (int16 pairs, or bf16 pairs) takes 16 such pairs. No strided view of `[num_blocks,
  block_size, heads, head_dim]` indexes that, so the tensors carry the pairs as axes: keys
  `[blocks, block_size / 2, 2, heads, head_dim / 2, 2]` and values `[blocks, block_size / 2,
  2, heads, head_dim]`, token `t` at `[t // 2, t % 2]`.

The last two store heads outermost: a sequence's blocks, allocated in order, then lie end to
end for each KV head, and the decode operator reads a (sequence, KV head) as one stream. Stored
blocks outermost, a head's part of a block was a piece of 2 KB (bf16, 16 tokens of 64 dims)
every few KB, and the operator read the cache at half the rate (`braid bench-attention
--read-rate`).
"""

from __future__ import annotations

import torch

TOKEN_MAJOR, TOKENS_INNERMOST, PAIRS = "token_major", "tokens_innermost", "pairs"
# The dtype that holds a pair of a paired cache's elements as one
_PAIR_AS_ONE = {torch.int8: torch.int16, torch.bfloat16: torch.int32}


def allocate(layout: str, num_blocks: int, block_size: int, heads: int, head_dim: int,
             dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed keys and values in `layout`."""
    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    blocks, pairs = num_blocks, block_size // 2
    if layout == TOKEN_MAJOR:
        shape = (blocks, block_size, heads, head_dim)
        return zeros(*shape), zeros(*shape)
    if layout == TOKENS_INNERMOST:
        keys = zeros(heads, blocks, head_dim, block_size).permute(1, 3, 0, 2)
        return keys, zeros(heads, blocks, block_size, head_dim).permute(1, 2, 0, 3)
    if (layout == PAIRS and dtype in (torch.int8, torch.bfloat16)
            and block_size % 2 == head_dim % 2 == 0):
        keys = zeros(heads, blocks, head_dim // 2, pairs, 2, 2).permute(1, 3, 4, 0, 2, 5)
        return keys, zeros(heads, blocks, pairs, head_dim, 2).permute(1, 2, 4, 0, 3)
    raise ValueError(f"no KV cache layout {layout!r} for {dtype}, block size {block_size}, "
                     f"head dim {head_dim}")


def is_paired(cache: torch.Tensor) -> bool:
    """Whether `cache` is in the `PAIRS` layout (the only one with pair axes)."""
    return cache.dim() > 4


def logical_shape(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, heads, head_dim) of a cache tensor in any layout."""
    if not is_paired(cache):
        return tuple(cache.shape)
    blocks, pairs, _, heads, *dims = cache.shape
    return blocks, 2 * pairs, heads, dims[0] * (dims[1] if len(dims) == 2 else 1)


def store(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rows `[T, ...]` (one per token) into their slots (`block * block_size + offset`)."""
    if cache.is_contiguous():
        cache.view(-1, *rows.shape[1:])[slot_mapping] = rows
        return
    block_size = logical_shape(cache)[1]
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    if is_paired(cache) and cache.dim() == 6 and not torch.compiler.is_compiling():
        # Paired keys: a pair of head dims read as one element of twice the width is laid out
        # as tokens innermost, whose write is an index_put on two indices (a fraction of the
        # time of a write through the pair axes: docs/kernel-choices.md). Not in a
        # compiled graph: inductor (torch 2.13) writes through such a dtype view wrongly.
        wide = _PAIR_AS_ONE[cache.dtype]
        cache = cache.view(wide).squeeze(-1).flatten(1, 2)
        rows = rows.view(wide)
    elif is_paired(cache):
        cache[block, offset // 2, offset % 2] = rows.view(*rows.shape[:2], *cache.shape[4:])
        return
    cache[block, offset] = rows


def blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The blocks `block_tables` names, `[*block_tables.shape, block_size, heads, head_dim]`
    (a contiguous copy)."""
    if not cache.is_contiguous():
        picked = cache[block_tables]
        if not is_paired(cache):
            # Indexing keeps the tokens-innermost strides; flattening the blocks into tokens
            # copies them into rows anyway, except for a single block, which then reached the
            # prefill operator with strided head dims.
            return picked.contiguous()
        first = block_tables.dim()  # the picked blocks' axes come first
        return picked.flatten(first + 3).flatten(first, first + 1)
    # One row copy per block: index_select on a 2-D view copies whole rows, several times
    # faster than fancy indexing or a gather along another dimension.
    num_blocks, *block_shape = cache.shape
    picked = cache.view(num_blocks, -1).index_select(0, block_tables.flatten())
    return picked.view(*block_tables.shape, *block_shape)
