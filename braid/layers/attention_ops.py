"""Attention kernels, one per shape of work, over token-major keys (`[..., keys, kv_heads,
dim]`, as the paged cache is indexed and its gather returns them; SDPA reads them strided).

Each is called the way that measured fastest for its shape and host (`braid bench-attention`
prints the table):
- `decode_attention`: one new token per sequence, through PyTorch's fused SDPA. A KV head's
  group of query heads takes the place of the query length, so keys are never repeated for
  grouped-query attention and the mask is one row of valid keys per sequence (`[B, 1, 1,
  keys]`), not one per query and head.
- prefill in bf16 on a CPU with AVX512-BF16 (`decode_kernel.prefill_fits`): the C++ operator
  `decode_kernel.causal_prefill_attention`, oneDNN's brgemm (AMX or `vdpbf16ps`) over keys
  packed once per KV head, key blocks past the diagonal skipped.
- prefill in bf16 without AMX where the operator is not used (it did not build, or the shapes
  do not fit it): `blocked_causal_attention`, batched GEMMs per query block that skip the
  masked triangle.
(Which of these a rank runs is its `KernelPlan`'s: `braid.worker.kernels` decides.)
- prefill elsewhere, through SDPA: `causal_attention` for the new tokens of one sequence
  (plainly causal when it has no cached prefix, else with that sequence's own `[new, prefix +
  new]` mask, no padding to the batch's longest sequence), and `batched_causal_attention` for
  fresh prompts of equal length in one call.

`traced_decode_attention` is the decode kernel for a step compiled whole
(`braid.worker.compiled_step`): plain reductions that inductor fuses with the reads of the
keys through the block table.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from braid.layers import kv_layout


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     key_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; keys: [B, L, Hk, D]; values: [B, L, Hk, Dv]; key_mask: [B, 1, 1, L]
    bool (True for a sequence's keys, False past its length) -> [B, Hq, Dv]."""
    batch, _, hk, dim = keys.shape
    queries = q.view(batch, hk, -1, dim)  # [B, Hk, g, D]
    out = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=key_mask, scale=scale)
    return out.reshape(batch, q.shape[1], -1)


def prefix_causal_mask(tokens: int, prefix: int, device: torch.device,
                       window: int | None = None) -> torch.Tensor:
    """[tokens, prefix + tokens] bool: new token t sees keys [0, prefix + t], or with a
    sliding `window` only the last `window` of them (its own included), as transformers'
    sliding-window mask has it."""
    keys = torch.arange(prefix + tokens, device=device)[None, :]
    queries = prefix + torch.arange(tokens, device=device)[:, None]
    mask = keys <= queries
    if window is not None:
        mask &= keys > queries - window
    return mask


def sliding_key_mask(key_mask: torch.Tensor, seq_lens: torch.Tensor,
                     window: int) -> torch.Tensor:
    """A decode `key_mask` ([B, 1, 1, L] bool) narrowed to each sequence's last `window` keys
    (`seq_lens` [B] keys per sequence, the new one last)."""
    keys = torch.arange(key_mask.shape[-1], device=key_mask.device)
    return key_mask & (keys >= (seq_lens - window)[:, None, None, None])


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


def traced_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, key_mask: torch.Tensor, scale: float,
                            k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_attention` over the paged cache, written for inductor: the keys and values are
    indexed through the block table inside the score and output reductions, so no gathered
    copy is made. q: [B, Hq, D]; caches: [blocks, block_size, Hk, D] (fastest in the
    tokens-innermost layout, `PagedAttention.allocate_cache`); block_tables: [B, W];
    key_mask: [B, 1, 1, W * block_size]; k_scales, v_scales: an int8 cache's [blocks,
    block_size, Hk] scales -> [B, Hq, Dv].

    Compiled, it is faster than the eager kernels called as an opaque operator at one
    sequence and close at 32 (docs/kernel-choices.md, "Attention"); eagerly it would be slow.
    """
    batch, width = block_tables.shape
    _, block_size, hk, dim = kv_layout.logical_shape(k_cache)
    # Per block: [B, W, Hk, 1, D, block_size] keys, summed over D for every token at once.
    keys = _scaled_blocks(k_cache, k_scales, block_tables).permute(0, 1, 3, 4, 2)[:, :, :, None]
    queries = q.view(batch, 1, hk, -1, dim, 1).float()  # [B, 1, Hk, g, D, 1]
    scores = (queries * keys.float()).sum(-2) * scale  # [B, W, Hk, g, block_size]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(batch, hk, -1, width * block_size)
    scores = scores.masked_fill(~key_mask.view(batch, 1, 1, -1), float("-inf"))
    # The softmax, normalised after the weighted sum: one division per output element instead
    # of one per key in the sum's inner loop.
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))  # [B, Hk, g, L]
    block_weights = weights.view(batch, hk, -1, width, block_size).permute(0, 3, 1, 2, 4)
    values = _scaled_blocks(v_cache, v_scales, block_tables)
    values = values.permute(0, 1, 3, 2, 4)[:, :, :, None]  # [B, W, Hk, 1, bs, Dv]
    out = (block_weights[..., None] * values.float()).sum((1, 4))  # [B, Hk, g, Dv]
    out = out / weights.sum(-1)[..., None]
    return out.to(q.dtype).view(batch, q.shape[1], -1)


def _scaled_blocks(cache: torch.Tensor, scales: torch.Tensor | None,
                   block_tables: torch.Tensor) -> torch.Tensor:
    """The blocks of `block_tables`, [B, W, block_size, H, D]; an int8 cache's times their
    scales, in float32."""
    blocks = kv_layout.blocks(cache, block_tables)
    return blocks if scales is None else blocks.float() * scales[block_tables][..., None]


# Query tokens per block of `blocked_causal_attention`: small enough that a block's scores stay
# in cache (larger blocks measured slower: docs/kernel-choices.md, "Prefill attention").
PREFILL_BLOCK = 64


def blocked_causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             scale: float, block: int = PREFILL_BLOCK) -> torch.Tensor:
    """Causal attention of new tokens after a cached prefix as batched GEMMs, one query block
    at a time against only the keys up to its diagonal: the masked upper triangle is never
    computed, and only the diagonal block is masked.

    q: [B, T, Hq, D]; keys: [B, P + T, Hk, D]; values: [B, P + T, Hk, Dv] (the P prefix keys
    first, the same P for every sequence) -> [B, T, Hq, Dv].

    A KV head's group of query heads is stacked into its query rows (rows are (token, head)),
    so keys are never repeated. Scores come out of the GEMM in the model's dtype, as in
    transformers' eager attention, and the softmax accumulates in fp32. Small blocks keep a
    block's scores in cache: on bf16 hosts without AMX it takes about a third of SDPA's time
    (`braid bench-attention`; docs/kernel-choices.md, "Prefill attention").
    """
    batch, tokens, hq, dim = q.shape
    length, hk, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    prefix, group = length - tokens, hq // hk
    queries = (q * scale).view(batch, tokens, hk, group, dim).transpose(1, 2)
    queries = queries.reshape(batch * hk, tokens * group, dim)
    keys = keys.transpose(1, 2).reshape(batch * hk, length, dim)
    values = values.transpose(1, 2).reshape(batch * hk, length, dv)
    out = q.new_empty(batch * hk, tokens * group, dv)
    for start in range(0, tokens, block):
        end = min(start + block, tokens)
        rows = slice(start * group, end * group)
        scores = torch.bmm(queries[:, rows], keys[:, :prefix + end].transpose(1, 2))
        scores[:, :, prefix + start:].masked_fill_(
            _above_diagonal(end - start, group, q.device), float("-inf"))
        torch.bmm(scores.softmax(-1), values[:, :prefix + end], out=out[:, rows])
    return out.view(batch, hk, tokens, group, dv).transpose(1, 2).reshape(batch, tokens, hq, dv)


@functools.lru_cache(maxsize=64)
def _above_diagonal(tokens: int, group: int, device: torch.device) -> torch.Tensor:
    """[tokens * group, tokens] bool: True where query row (token, head) must not see a key of
    its own block (a later token)."""
    token = torch.arange(tokens * group, device=device) // group
    return torch.arange(tokens, device=device)[None, :] > token[:, None]
