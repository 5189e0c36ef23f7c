"""Attention over a paged KV cache, for prefill (with or without a cached prefix) and decode:
the kernel is chosen by the shape of each group of sequences (see `attention_ops`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from braid.layers import kv_layout
from braid.layers.attention_ops import (
    batched_causal_attention,
    blocked_causal_attention,
    blocked_prefill_is_faster,
    causal_attention,
    decode_attention,
    sliding_key_mask,
    traced_decode_attention,
)
from braid.layers.decode_kernel import (
    causal_prefill_attention,
    paged_decode_attention,
    pairs_fit,
)
from braid.layers.forward_batch import AttentionMetadata, ForwardBatch


class PagedAttention(nn.Module):
    """Writes the step's keys and values into the cache, then attends over each sequence's keys.

    The cache tensors (`[num_blocks, block_size, kv_heads, head_dim]` in one of `kv_layout`'s
    layouts, which `allocate_cache` picks) are attached by the model runner after it has sized
    the cache. An int8 cache (`--kv-cache-dtype int8`) comes with `k_scales` and `v_scales`,
    `[num_blocks, block_size, kv_heads]` float32: a stored row is its int8 values times its
    scale (`quantize_rows`).
    They start zeroed, so the unused tail of a sequence's last block holds finite values, which
    the length mask then excludes.

    `runs` (`HeadShard.runs()`) lists the rank's head ranges that are each uniformly grouped
    (a rank holding part of a KV head's query group); by default all heads form one.

    `window`: a sliding-window layer's queries see only the last `window` keys, their own
    included (Mistral, Gemma 3's local layers). Where a group's sequences are longer than
    that, it attends through masks (`AttentionMetadata.windowed`): SDPA, or the traced decode
    kernel in a compiled step, not the C++ operators, which attend causally over every key.
    `scale`: the softmax scale, head_dim ** -0.5 unless the model says otherwise.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 runs: list[tuple[int, int, int, int]] | None = None, *,
                 window: int | None = None, scale: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.runs = runs or [(0, num_heads, 0, num_kv_heads)]
        padded, kept = _padded_groups(self.runs) or (None, None)
        # buffers, so that they follow the model to its device
        self.register_buffer("decode_padded", padded, persistent=False)
        self.register_buffer("decode_kept", kept, persistent=False)
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None
        # Set where `decode_kernel.attention_fits`, for the compiled decode step (its decode
        # attention is then the C++ operator instead of `traced_decode_attention`) and for
        # eager decode steps (`compiled_step.eager_decode_reads_kernel`).
        self.use_decode_kernel = False
        # Set where `decode_kernel.prefill_fits` (bf16, AVX512-BF16): prefill attention is then
        # the C++ operator, for fresh prompts and chunks over a cached prefix alike.
        self.use_prefill_kernel = False

    @property
    def padded_heads(self) -> int:
        """Query heads a grouped decode call computes: the rank's heads, with its short groups
        padded to the largest (`_padded_groups`), so that every KV head serves as many."""
        return self.num_heads if self.decode_padded is None else len(self.decode_padded)

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, tokens_innermost: bool = False) -> None:
        """Zeroed: masked-out keys must still be finite (0 * NaN would poison the output).
        `dtype` int8 stores rows quantized, with their scales (laid out as the keys' tokens).

        Stored token-major by default. `tokens_innermost` is the layout of the decode steps
        that read the cache through `decode_kernel` (on CPU where it fits) or compile, so that
        `traced_decode_attention` sums each score over head_dim as vector FMAs across a
        block's tokens, not as one horizontal reduction per key (30 compiled layers of SmolLM2
        at batch 32, 2 cores, bf16: 23 ms against 15; 0.89 against 0.73 ms at batch 1); an int8
        or bf16 cache the operator reads in pairs is stored in pairs (`kv_layout.PAIRS`).
        """
        layout = kv_layout.TOKEN_MAJOR
        if tokens_innermost:
            paired = pairs_fit(dtype, block_size, self.head_dim)
            layout = kv_layout.PAIRS if paired else kv_layout.TOKENS_INNERMOST
        self.k_cache, self.v_cache = kv_layout.allocate(layout, num_blocks, block_size,
                                                        self.num_kv_heads, self.head_dim, dtype,
                                                        device)
        self.k_scales = self.v_scales = None
        if dtype == torch.int8:
            self.k_scales = row_scales(num_blocks, block_size, self.num_kv_heads, device,
                                       tokens_innermost)
            self.v_scales = row_scales(num_blocks, block_size, self.num_kv_heads, device,
                                       tokens_innermost)

    def cache_tensors(self) -> list[torch.Tensor]:
        """The cache's tensors: keys and values, and an int8 cache's scales."""
        return [t for t in (self.k_cache, self.v_cache, self.k_scales, self.v_scales)
                if t is not None]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        write_cache(self.k_cache, k, batch.slot_mapping, self.k_scales)
        write_cache(self.v_cache, v, batch.slot_mapping, self.v_scales)
        if torch.compiler.is_compiling():
            # A decode step traced whole (braid.worker.compiled_step).
            meta = batch.attn_groups[0].meta
            if self.use_decode_kernel and self.window is None:
                return self._decode_kernel(q, meta).flatten(1)
            key_mask = meta.key_mask
            if self.window is not None:
                key_mask = sliding_key_mask(key_mask, meta.seq_lens, self.window)
            return padded_decode(traced_decode_attention, q, self.k_cache, self.v_cache,
                                 meta.block_tables, key_mask, self.scale, self.k_scales,
                                 self.v_scales, padded=self.decode_padded,
                                 kept=self.decode_kept).flatten(1)
        return concat_groups([self._attend(q[g.tokens], k[g.tokens], v[g.tokens], g.meta)
                              for g in batch.attn_groups])

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One group of sequences (see `AttentionMetadata` for the three ways)."""
        kernels = True
        if self.window is not None:
            windowed = meta.windowed(self.window)
            kernels, meta = windowed is meta, windowed
        if meta.decode and self.use_decode_kernel and kernels:
            out = self._decode_kernel(q, meta)
        elif meta.decode:
            keys = gather_blocks(self.k_cache, meta.block_tables, self.k_scales, q.dtype)
            values = gather_blocks(self.v_cache, meta.block_tables, self.v_scales, q.dtype)
            out = padded_decode(decode_attention, q, keys, values, meta.key_mask, self.scale,
                                padded=self.decode_padded, kept=self.decode_kept)
        elif meta.equal_fresh:
            shape = (meta.batch_size, meta.q_lens[0], -1, self.head_dim)
            kernel = self._prefill_kernel(q) or batched_causal_attention
            out = self._by_runs(kernel, q.view(shape), k.view(shape), v.view(shape), self.scale)
        else:
            out = concat_groups([self._attend_sequence(q, k, v, meta, b, kernels)
                                 for b in range(meta.batch_size)])
        return out.reshape(q.shape[0], -1)

    def _attend_sequence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         meta: AttentionMetadata, b: int, kernels: bool) -> torch.Tensor:
        rows = slice(meta.q_starts[b], meta.q_starts[b] + meta.q_lens[b])
        blocks = meta.key_blocks[b]
        if blocks is None:  # a fresh prompt: its keys are the new ones
            keys, values = k[rows], v[rows]
        else:
            keys = gather_blocks(self.k_cache, blocks[None], self.k_scales,
                                 q.dtype)[0, :meta.kv_lens[b]]
            values = gather_blocks(self.v_cache, blocks[None], self.v_scales,
                                   q.dtype)[0, :meta.kv_lens[b]]
        if kernels and (kernel := self._prefill_kernel(q)):
            return self._by_runs(kernel, q[rows][None], keys[None], values[None],
                                 self.scale)[0]
        return self._by_runs(causal_attention, q[rows], keys, values, meta.masks[b], self.scale)

    def _decode_kernel(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode rows through the C++ operator, in one call for all of the rank's runs."""
        return padded_decode(paged_decode_attention, q, self.k_cache, self.v_cache,
                             meta.block_tables, meta.seq_lens, self.scale, self.k_scales,
                             self.v_scales, padded=self.decode_padded, kept=self.decode_kept)

    def _prefill_kernel(self, q: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The prefill kernel that beats SDPA here, taking `[B, T, H, D]` queries over `[B, L,
        Hk, D]` keys (the last T their own): the C++ operator (bf16 on AVX512-BF16), else the
        blocked GEMMs (bf16 without AMX); None where SDPA is the faster."""
        if self.use_prefill_kernel:
            return causal_prefill_attention
        if blocked_prefill_is_faster(q.dtype, q.device):
            return blocked_causal_attention
        return None

    def _by_runs(self, kernel: Callable[..., torch.Tensor], q: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, *args: object) -> torch.Tensor:
        """`kernel(q, keys, values, *args)` per uniformly grouped run of heads (the head axis
        is the second last of all three), outputs joined along the heads."""
        if len(self.runs) == 1:
            return kernel(q, keys, values, *args)
        return torch.cat([
            kernel(q[..., qs:qs + qn, :], keys[..., ks:ks + kn, :], values[..., ks:ks + kn, :],
                   *args)
            for qs, qn, ks, kn in self.runs], dim=-2)


def _padded_groups(runs: list[tuple[int, int, int, int]]
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For runs of unequal group sizes: the query heads that give every KV head the largest
    group (a short group repeats its last head), and where each real head's output lands in
    that padded order. None for a single run (nothing to pad)."""
    if len(runs) == 1:
        return None
    group = max(qn // kn for _, qn, _, kn in runs)
    padded, kept = [], []
    for qs, qn, _, kn in runs:
        size = qn // kn
        for k in range(kn):
            heads = list(range(qs + k * size, qs + (k + 1) * size))
            kept += range(len(padded), len(padded) + size)
            padded += heads + heads[-1:] * (group - size)
    return torch.tensor(padded), torch.tensor(kept)


def padded_decode(kernel: Callable[..., torch.Tensor], q: torch.Tensor, *args: object,
                  padded: torch.Tensor | None, kept: torch.Tensor | None) -> torch.Tensor:
    """A decode kernel's `kernel(q, *args)` -> [B, heads, Dv] in one grouped call even when the
    rank's KV heads serve unequal query groups (`_padded_groups`): the short groups are padded
    with a repeated query head whose output is dropped (an extra query row costs little beside
    reading the keys; a call per run took 14% longer at tp 2, bs 32)."""
    if padded is None:
        return kernel(q, *args)
    return kernel(q.index_select(1, padded), *args).index_select(1, kept)


def row_scales(num_blocks: int, block_size: int, heads: int, device: torch.device,
               tokens_innermost: bool = False) -> torch.Tensor:
    """Zeroed float32 scales of an int8 cache, indexed `[num_blocks, block_size, heads]`; stored
    `[num_blocks, heads, block_size]` when `tokens_innermost`, as the decode kernel reads them
    next to the keys."""
    if tokens_innermost:
        return torch.zeros(num_blocks, heads, block_size, device=device).permute(0, 2, 1)
    return torch.zeros(num_blocks, block_size, heads, device=device)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., dim] -> (int8 values [..., dim], float32 scales [...]) with rows ~ values * scales:
    symmetric, one scale per row (a token's head), its largest magnitude stored as 127. The
    error is at most half a scale, about 0.4% of the row's largest element."""
    x = rows.float()
    scales = x.abs().amax(-1) / 127
    divisors = scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return (x / divisors).round_().to(torch.int8), scales


def write_cache(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor,
                scales: torch.Tensor | None = None) -> None:
    """Store the step's per-token rows `new` ([T, ...]) at their slots of a cache (of any
    `kv_layout`); quantized (`quantize_rows`) into an int8 cache, whose `scales` take the
    rows' scales."""
    if scales is not None:
        new, new_scales = quantize_rows(new)
        kv_layout.store(scales, new_scales, slot_mapping)
    kv_layout.store(cache, new, slot_mapping)


def concat_groups(outputs: list[torch.Tensor]) -> torch.Tensor:
    """Outputs in step order; a single one (most steps) is not copied."""
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor,
                  scales: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, blocks] block ids -> [B, blocks * block_size, ...] (the cache's per-token shape); an
    int8 cache's rows times their `scales`, in `dtype` (int8 values are exact in bf16, so the
    product is computed there: two passes over the rows instead of four through fp32)."""
    rows = kv_layout.blocks(cache, block_tables).flatten(1, 2)
    if scales is None:
        return rows
    scales = kv_layout.blocks(scales, block_tables).flatten(1, 2)
    return rows.to(dtype).mul_(scales.to(dtype)[..., None])
