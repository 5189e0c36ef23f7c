"""Attention kernels, one per shape of work, over token-major keys (`[..., keys, kv_heads,
dim]`, as the paged cache stores them and its gather returns them; SDPA reads them strided).

Each is PyTorch's fused SDPA called the way that measured fastest for its shape (`braid
bench-attention` prints the table; GEMM-and-softmax variants that skip the masked triangle
lost to these at every shape on the AVX-512 hosts measured, in bf16 and fp32):
- `decode_attention`: one new token per sequence. A KV head's group of query heads takes the
  place of the query length, so keys are never repeated for grouped-query attention and the
  mask is one row of valid keys per sequence (`[B, 1, 1, keys]`), not one per query and head.
- `causal_attention`: the new tokens of one sequence, plainly causal when it has no cached
  prefix, else with that sequence's own `[new, prefix + new]` mask (no padding to the batch's
  longest sequence).
- `batched_causal_attention`: fresh prompts of equal length in one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     key_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; keys: [B, L, Hk, D]; values: [B, L, Hk, Dv]; key_mask: [B, 1, 1, L]
    bool (True for a sequence's keys, False past its length) -> [B, Hq, Dv]."""
    batch, _, hk, dim = keys.shape
    queries = q.view(batch, hk, -1, dim)  # [B, Hk, g, D]
    out = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=key_mask, scale=scale)
    return out.reshape(batch, q.shape[1], -1)


def prefix_causal_mask(tokens: int, prefix: int, device: torch.device) -> torch.Tensor:
    """[tokens, prefix + tokens] bool: new token t sees keys [0, prefix + t]."""
    keys = torch.arange(prefix + tokens, device=device)
    return keys[None, :] <= prefix + torch.arange(tokens, device=device)[:, None]


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The new tokens of one sequence. q: [T, Hq, D]; keys: [K, Hk, D]; values: [K, Hk, Dv];
    mask: `prefix_causal_mask` when K > T (a cached prefix), None when K == T -> [T, Hq, Dv]."""
    gqa = q.shape[1] != keys.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=gqa)
    return out[0].transpose(0, 1)


def batched_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Fresh prompts of equal length T: q: [B, T, Hq, D]; k: [B, T, Hk, D]; v: [B, T, Hk, Dv]
    -> [B, T, Hq, Dv]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
