"""Attention over a paged KV cache, for prefill (with or without a cached prefix) and decode."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.engine.batch import AttentionMetadata, ForwardBatch


class PagedAttention(nn.Module):
    """Writes the step's keys and values into the cache, then attends over each sequence's cache.

    The cache tensors (`[num_blocks, block_size, kv_heads, head_dim]`) are attached by the model
    runner after it has sized the cache. They start zeroed, so the unused tail of a sequence's
    last block holds finite values, which the mask then excludes.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> None:
        """Zeroed: masked-out keys must still be finite (0 * NaN would poison the output)."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        self.k_cache.view(-1, *k.shape[1:])[batch.slot_mapping] = k
        self.v_cache.view(-1, *v.shape[1:])[batch.slot_mapping] = v
        return concat_groups([self._attend(q[g.tokens], k[g.tokens], v[g.tokens], g.meta)
                              for g in batch.attn_groups])

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One group of sequences (see `AttentionGroup`)."""
        b, max_q = meta.batch_size, meta.max_q
        gqa = self.num_heads != self.num_kv_heads
        if meta.fresh_causal:
            out = F.scaled_dot_product_attention(
                q.view(b, max_q, -1, self.head_dim).transpose(1, 2),
                k.view(b, max_q, -1, self.head_dim).transpose(1, 2),
                v.view(b, max_q, -1, self.head_dim).transpose(1, 2),
                is_causal=True, enable_gqa=gqa)
            return out.transpose(1, 2).reshape(q.shape[0], -1)
        q_padded = q if meta.q_gather is None else q[meta.q_gather]
        keys = gather_blocks(self.k_cache, meta.block_tables).transpose(1, 2)  # [B, kv, keys, D]
        values = gather_blocks(self.v_cache, meta.block_tables).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_padded.view(b, max_q, -1, self.head_dim).transpose(1, 2), keys, values,
            attn_mask=meta.mask, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(b * max_q, -1)
        return out if meta.q_scatter is None else out[meta.q_scatter]


def concat_groups(outputs: list[torch.Tensor]) -> torch.Tensor:
    """The attention groups' outputs in step order; one group (most steps) is not copied."""
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, blocks] block ids -> [B, blocks * block_size, ...] (the cache's per-token shape), one
    row copy per block (index_select on a 2-D view copies whole rows, several times faster than
    fancy indexing)."""
    num_blocks, block_size, *token_shape = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_tables.flatten())
    return rows.view(block_tables.shape[0], -1, *token_shape)
