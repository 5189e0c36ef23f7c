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

from braid.engine.batch import AttentionMetadata, ForwardBatch
from braid.layers.attention import concat_groups, gather_blocks


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

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> None:
        """Zeroed, so masked-out slots hold finite values."""
        shape = (num_blocks, block_size, self.kv_lora_rank + self.rope_dim)
        self.cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                kv_b_weight: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q_nope: [T, heads, nope], q_rope: [T, heads, rope], latent: [T, kv_lora + rope]
        (the step's new tokens), kv_b_weight: [heads * (nope + v), kv_lora] for this rank's
        heads -> [T, heads * v]."""
        self.cache.view(-1, latent.shape[-1])[batch.slot_mapping] = latent
        kv_b = kv_b_weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return concat_groups([self._attend(q_nope[g.tokens], q_rope[g.tokens], latent[g.tokens],
                                           kv_b, g.meta) for g in batch.attn_groups])

    def _attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                kv_b: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One group of sequences (see `AttentionGroup`): absorbed for decode rows."""
        absorbed = self.mode == "absorbed" or (self.mode == "auto" and meta.max_q == 1)
        if meta.fresh_causal:
            keys = latent.view(meta.batch_size, meta.max_q, -1)  # the new tokens are all keys
        else:
            keys = gather_blocks(self.cache, meta.block_tables)  # [B, keys, kv_lora + rope]
            if meta.q_gather is not None:
                q_nope, q_rope = q_nope[meta.q_gather], q_rope[meta.q_gather]
        if absorbed:
            out = self._absorbed(q_nope, q_rope, keys, kv_b, meta)
        else:
            out = self._expanded(q_nope, q_rope, keys, kv_b, meta)
        out = out.reshape(-1, self.num_heads * self.v_dim)
        return out if meta.fresh_causal or meta.q_scatter is None else out[meta.q_scatter]

    def _expanded(self, q_nope, q_rope, keys, kv_b, meta) -> torch.Tensor:
        b, max_q, h = meta.batch_size, meta.max_q, self.num_heads
        latent_kv, k_rope = keys.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = F.linear(latent_kv, kv_b.view(-1, self.kv_lora_rank))
        kv = kv.view(b, -1, h, self.nope_dim + self.v_dim).transpose(1, 2)  # [B, h, keys, .]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, h, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).view(b, max_q, h, -1).transpose(1, 2)
        # SDPA's fused kernels want one head size for q, k and v; zero-padding v to it is
        # 1.5-2.5x faster on CPU than the generic path taken for v 128 against qk 192.
        v = F.pad(v, (0, max(0, k.shape[-1] - self.v_dim)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask,
                                             is_causal=meta.fresh_causal, scale=self.scale)
        return out[..., :self.v_dim].transpose(1, 2)  # [B, max_q, h, v]

    def _absorbed(self, q_nope, q_rope, keys, kv_b, meta) -> torch.Tensor:
        b, max_q, h = meta.batch_size, meta.max_q, self.num_heads
        w_k, w_v = kv_b.split([self.nope_dim, self.v_dim], dim=1)  # [h, nope|v, kv_lora]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_k).transpose(0, 1)  # [T, h, kv_lora]
        # All heads read the same latent keys: fold heads into the query axis (one KV head).
        q = torch.cat([q_latent, q_rope], dim=-1).reshape(b, 1, max_q * h, -1)
        mask = meta.mask
        if meta.fresh_causal and max_q > 1:
            mask = torch.ones(max_q, max_q, dtype=torch.bool, device=q.device).tril()[None, None]
        if mask is not None and max_q > 1:  # one mask row per (query, head)
            mask = mask.repeat_interleave(h, dim=2)
        keys = keys[:, None]
        # The values are the latents' first kv_lora_rank columns. Passing the whole rows keeps
        # one head size (SDPA's fused path, about 1.8x faster here); the extra output columns
        # are dropped.
        out = F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask, scale=self.scale)
        out = out[..., :self.kv_lora_rank].reshape(b * max_q, h, -1).transpose(0, 1)
        return torch.bmm(out, w_v.transpose(1, 2)).transpose(0, 1)  # [T, h, v]
