"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

Each token stores one latent row, `[kv_lora_rank normalised KV | qk_rope_head_dim rotated
key]`, shared by all heads, so every tensor-parallel rank keeps the same cache and only
`kv_b_proj` (which expands a latent into per-head keys and values) is split by heads.

Two equal ways to attend:
- expanded (prefill): `kv_b_proj` turns every attended latent into keys and values of this
  rank's heads, then plain attention with head dim nope + rope and value dim v.
- absorbed (decode): the key half of `kv_b_proj` is folded into the query and the value half
  into the output, so attention runs directly on the latents, one shared key/value "head" for
  all query heads; no per-token expansion of the whole context at every step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.layers.attention import (
    PLAIN,
    concat_groups,
    gather_blocks,
    row_scales,
    write_cache,
)
from braid.layers.attention_ops import causal_attention, decode_attention, prefix_causal_mask
from braid.layers.forward_batch import AttentionMetadata, ForwardBatch
from braid.layers.kernel_plan import KernelPlan


class LatentAttention(nn.Module):
    """The attention core of MLA for `num_heads` local heads; owns the latent cache."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim = qk_nope_head_dim
        self.rope_dim = qk_rope_head_dim
        self.v_dim = v_head_dim
        self.scale = scale
        self.mode = "auto"  # "auto" (absorbed for decode steps), "expanded" or "absorbed"
        self.cache: torch.Tensor | None = None
        self.cache_scales: torch.Tensor | None = None  # an int8 cache's, one per latent row

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, kernels: KernelPlan = PLAIN) -> None:
        """Zeroed, so masked-out slots hold finite values; one shared KV "head". `dtype` int8
        stores each latent row quantized (`attention.quantize_rows`), with its scale. The
        latent cache has one layout and its own kernels, whatever the plan says (`kernels`
        is taken as every attention layer's cache is made)."""
        shape = (num_blocks, block_size, 1, self.kv_lora_rank + self.rope_dim)
        self.cache = torch.zeros(shape, dtype=dtype, device=device)
        self.cache_scales = (row_scales(num_blocks, block_size, 1, device)
                             if dtype == torch.int8 else None)

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                kv_b_weight: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q_nope: [T, heads, nope], q_rope: [T, heads, rope], latent: [T, kv_lora + rope]
        (the step's new tokens), kv_b_weight: [heads * (nope + v), kv_lora] for this rank's
        heads -> [T, heads * v]."""
        write_cache(self.cache, latent[:, None], batch.slot_mapping, self.cache_scales)
        kv_b = kv_b_weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return concat_groups([self._attend(q_nope[g.tokens], q_rope[g.tokens], latent[g.tokens],
                                           kv_b, g.meta) for g in batch.attn_groups])

    def _attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                kv_b: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One group of sequences (see `AttentionMetadata`): decode rows absorbed, in one call;
        otherwise sequence by sequence."""
        absorbed = self.mode == "absorbed" or (self.mode == "auto" and meta.decode)
        w_k, w_v = kv_b.split([self.nope_dim, self.v_dim], dim=1)  # [h, nope|v, kv_lora]
        if absorbed:
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_k).transpose(0, 1)  # [T, h, lora]
            q = torch.cat([q_latent, q_rope], dim=-1)
        else:
            q = torch.cat([q_nope, q_rope], dim=-1)
        if absorbed and meta.decode:
            keys = gather_blocks(self.cache, meta.block_tables, self.cache_scales,
                                 q.dtype)  # [B, L, 1, kv_lora + rope]
            # The values are the latents' first kv_lora_rank columns. Passing the whole rows
            # keeps one head size (SDPA's fused path, the faster here); the extra
            # output columns are dropped.
            out = decode_attention(q, keys, keys, meta.key_mask, self.scale)
        else:
            out = concat_groups([self._attend_sequence(q, latent, kv_b, meta, b, absorbed)
                                 for b in range(meta.batch_size)])
        if absorbed:  # [T, h, kv_lora] -> [T, h, v]
            out = out[..., :self.kv_lora_rank].transpose(0, 1)
            out = torch.bmm(out, w_v.transpose(1, 2)).transpose(0, 1)
        return out.reshape(-1, self.num_heads * self.v_dim)

    def _attend_sequence(self, q: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor,
                         meta: AttentionMetadata, b: int, absorbed: bool) -> torch.Tensor:
        """Sequence b's new tokens against its latents: causal attention on the latents
        themselves (absorbed; output [T, h, kv_lora + rope]), or on the keys and values they
        expand to (output [T, h, v])."""
        rows = slice(meta.q_starts[b], meta.q_starts[b] + meta.q_lens[b])
        q = q[rows]
        if meta.decode:  # only when attention is forced to the expanded form
            blocks = meta.block_tables[b]
            mask = prefix_causal_mask(1, meta.kv_lens[b] - 1, q.device)
        else:
            blocks, mask = meta.key_blocks[b], meta.masks[b]
        if blocks is None:  # a fresh prompt: its latents are the new ones
            keys = latent[rows][:, None]
        else:
            keys = gather_blocks(self.cache, blocks[None], self.cache_scales,
                                 latent.dtype)[0, :meta.kv_lens[b]]  # [K, 1, .]
        if absorbed:  # all heads read one shared latent "head"; whole rows as values (above)
            return causal_attention(q, keys, keys, mask, self.scale)
        latent_kv, k_rope = keys[:, 0].split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = F.linear(latent_kv, kv_b.view(-1, self.kv_lora_rank))
        kv = kv.view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [keys, h, .]
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, self.num_heads, -1)], dim=-1)
        # SDPA's fused kernels want one head size for q, k and v; zero-padding v to it is
        # faster on CPU than the generic path taken for v 128 against qk 192.
        v = F.pad(v, (0, max(0, k.shape[-1] - self.v_dim)))
        return causal_attention(q, k, v, mask, self.scale)[..., :self.v_dim]
