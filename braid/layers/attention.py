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
    causal_attention,
    decode_attention,
    sliding_key_mask,
    traced_decode_attention,
)
from braid.layers.decode_kernel import causal_prefill_attention, paged_decode_attention
from braid.layers.forward_batch import AttentionMetadata, ForwardBatch
from braid.layers.kernel_plan import KernelPlan

PLAIN = KernelPlan()  # a layer's kernels outside a rank: token-major cache, ATen and SDPA
# The prefill kernels a plan may name, taking `[B, T, H, D]` queries over `[B, L, Hk, D]` keys
# (the last T their own); None: SDPA (`causal_attention`, `batched_causal_attention`)
PREFILL_KERNELS = {"operator": causal_prefill_attention, "blocked": blocked_causal_attention,
                   "sdpa": None}


class PagedAttention(nn.Module):
    """Writes the step's keys and values into the cache, then attends over each sequence's keys.

    The cache tensors (`[num_blocks, block_size, kv_heads, head_dim]` in one of `kv_layout`'s
    layouts, as the rank's `KernelPlan` says) are made by `allocate_cache` once the model runner
    has sized the cache. An int8 cache (`--kv-cache-dtype int8`) comes with `k_scales` and
    `v_scales`, `[num_blocks, block_size, kv_heads]` float32: a stored row is its int8 values
    times its scale (`quantize_rows`).
    They start zeroed, so the unused tail of a sequence's last block holds finite values, which
    the length mask then excludes.

    `runs` (`HeadShard.runs()`) lists the rank's head ranges that are each uniformly grouped
    (a rank holding part of a KV head's query group); by default all heads form one.
    `kv_parts` (`HeadShard.kv_parts`): shared KV heads split over sequences. The rank then
    holds `num_heads` query heads, every one of its KV heads' groups, of which it attends its
    own (`own_offset`, the heads `runs` cover) in prefill; decode steps through the C++
    operator attend all of them, each shared KV head over the rows whose part (a hash of the
    row's length and input token, the same in any batch) is the rank's. The heads or rows
    another rank attends come out as zeros.

    `window`: a sliding-window layer's queries see only the last `window` keys, their own
    included (Mistral, Gemma 3's local layers). Where a group's sequences are longer than
    that, it attends through masks (`AttentionMetadata.windowed`): SDPA, or the traced decode
    kernel in a compiled step, not the C++ operators, which attend causally over every key.
    `scale`: the softmax scale, head_dim ** -0.5 unless the model says otherwise.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 runs: list[tuple[int, int, int, int]] | None = None, *,
                 window: int | None = None, scale: float | None = None,
                 kv_parts: tuple[tuple[int, int], ...] = (), own_offset: int = 0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.runs = runs or [(0, num_heads, 0, num_kv_heads)]
        self.own_offset = own_offset
        self.own_heads = sum(run[1] for run in self.runs)
        self.register_buffer("kv_parts", torch.tensor(kv_parts) if kv_parts else None,
                             persistent=False)
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
        # Chosen with the cache (`allocate_cache`, from the rank's `KernelPlan`): decode rows
        # through the C++ operator (eager and in the compiled decode graph) instead of SDPA
        # over gathered blocks (`traced_decode_attention` in a graph), and the prefill kernel
        # that beats SDPA here, if one does (`PREFILL_KERNELS`).
        self.decode_operator = False
        self.prefill_kernel: Callable[..., torch.Tensor] | None = None

    @property
    def padded_heads(self) -> int:
        """Query heads a grouped decode call computes: the rank's heads, with its short groups
        padded to the largest (`_padded_groups`), so that every KV head serves as many."""
        return self.num_heads if self.decode_padded is None else len(self.decode_padded)

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, kernels: KernelPlan = PLAIN) -> None:
        """Zeroed: masked-out keys must still be finite (0 * NaN would poison the output).
        `dtype` int8 stores rows quantized, with their scales (laid out as the keys' tokens).

        Laid out as `kernels.kv_layout` says, with the attention kernels that read that layout:
        token-major by default; keys with a block's tokens innermost where decode steps read the
        cache through `decode_kernel`'s operator or compile, so that `traced_decode_attention`
        sums each score over head_dim as vector FMAs across a block's tokens, not as one
        horizontal reduction per key; in pairs where the operator reads an int8 or bf16 cache
        two elements at a time (`kv_layout.PAIRS`)."""
        layout = kernels.kv_layout
        self.k_cache, self.v_cache = kv_layout.allocate(layout, num_blocks, block_size,
                                                        self.num_kv_heads, self.head_dim, dtype,
                                                        device)
        self.k_scales = self.v_scales = None
        if dtype == torch.int8:
            innermost = layout != kv_layout.TOKEN_MAJOR
            self.k_scales = row_scales(num_blocks, block_size, self.num_kv_heads, device,
                                       innermost)
            self.v_scales = row_scales(num_blocks, block_size, self.num_kv_heads, device,
                                       innermost)
        self.decode_operator = kernels.decode_attention == "operator"
        self.prefill_kernel = PREFILL_KERNELS[kernels.prefill_attention]

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
            if self.decode_operator and self.window is None:
                return self._decode_kernel(q, meta, batch.input_ids).flatten(1)
            key_mask = meta.key_mask
            if self.window is not None:
                key_mask = sliding_key_mask(key_mask, meta.seq_lens, self.window)
            return self._held(padded_decode(
                traced_decode_attention, self._own(q), self.k_cache, self.v_cache,
                meta.block_tables, key_mask, self.scale, self.k_scales, self.v_scales,
                padded=self.decode_padded, kept=self.decode_kept)).flatten(1)
        return concat_groups([self._attend(q[g.tokens], k[g.tokens], v[g.tokens], g.meta,
                                           batch.input_ids[g.tokens])
                              for g in batch.attn_groups])

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, tokens: torch.Tensor) -> torch.Tensor:
        """One group of sequences (see `AttentionMetadata` for the three ways); `tokens`:
        its input token ids."""
        kernels = True
        if self.window is not None:
            windowed = meta.windowed(self.window)
            kernels, meta = windowed is meta, windowed
        if meta.decode and self.decode_operator and kernels:
            return self._decode_kernel(q, meta, tokens).flatten(1)
        rows, q = q.shape[0], self._own(q)
        if meta.decode:
            keys = gather_blocks(self.k_cache, meta.block_tables, self.k_scales, q.dtype)
            values = gather_blocks(self.v_cache, meta.block_tables, self.v_scales, q.dtype)
            out = padded_decode(decode_attention, q, keys, values, meta.key_mask, self.scale,
                                padded=self.decode_padded, kept=self.decode_kept)
        elif meta.equal_fresh:
            shape = (meta.batch_size, meta.q_lens[0], -1, self.head_dim)
            kernel = self.prefill_kernel or batched_causal_attention
            out = self._by_runs(kernel, q.reshape(shape), k.view(shape), v.view(shape),
                                self.scale)
        else:
            out = concat_groups([self._attend_sequence(q, k, v, meta, b, kernels)
                                 for b in range(meta.batch_size)])
        return self._held(out.reshape(rows, self.own_heads, -1)).flatten(1)

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
        if kernels and self.prefill_kernel is not None:
            return self._by_runs(self.prefill_kernel, q[rows][None], keys[None], values[None],
                                 self.scale)[0]
        return self._by_runs(causal_attention, q[rows], keys, values, meta.masks[b], self.scale)

    def _decode_kernel(self, q: torch.Tensor, meta: AttentionMetadata,
                       tokens: torch.Tensor) -> torch.Tensor:
        """Decode rows (input tokens `tokens`) through the C++ operator, in one call for all
        of the rank's runs, or for all of its held heads, each shared KV head over the rows of
        the rank's part (`kv_parts`)."""
        if self.kv_parts is not None:
            return paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                          meta.seq_lens, self.scale, self.k_scales,
                                          self.v_scales, self.kv_parts, tokens)
        return padded_decode(paged_decode_attention, q, self.k_cache, self.v_cache,
                             meta.block_tables, meta.seq_lens, self.scale, self.k_scales,
                             self.v_scales, padded=self.decode_padded, kept=self.decode_kept)

    def _own(self, q: torch.Tensor) -> torch.Tensor:
        """[T, held heads, D] -> the rank's own heads (those `runs` cover)."""
        return q if self.kv_parts is None else q.narrow(1, self.own_offset, self.own_heads)

    def _held(self, out: torch.Tensor) -> torch.Tensor:
        """[T, own heads, D] -> [T, held heads, D]: zeros for the heads other ranks attend."""
        if self.kv_parts is None:
            return out
        after = self.num_heads - self.own_offset - self.own_heads
        return torch.nn.functional.pad(out, (0, 0, self.own_offset, after))

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
    reading the keys; a call per run was the slower)."""
    if padded is None:
        return kernel(q, *args)
    return kernel(q.index_select(1, padded), *args).index_select(1, kept)


def row_scales(num_blocks: int, block_size: int, heads: int, device: torch.device,
               tokens_innermost: bool = False) -> torch.Tensor:
    """Zeroed float32 scales of an int8 cache, indexed `[num_blocks, block_size, heads]`; stored
    `[heads, num_blocks, block_size]` when `tokens_innermost`, as the decode kernel reads them
    beside the keys (`kv_layout`: heads outermost)."""
    if tokens_innermost:
        return torch.zeros(heads, num_blocks, block_size, device=device).permute(1, 2, 0)
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
