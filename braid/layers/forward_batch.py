"""What the layers see of one forward step: the step's tokens as tensors (`ForwardBatch`) and
how each group of its sequences attends (`AttentionMetadata`), built once per step for every
layer. The engine builds a `ForwardBatch` from its `StepPlan` (`braid.step`); nothing
here imports the engine."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from braid.layers.attention_ops import prefix_causal_mask, sliding_key_mask


class StepArrays(Protocol):
    """The fields of a step plan a `ForwardBatch` reads (`braid.step.StepPlan`)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    q_lens: np.ndarray
    kv_lens: np.ndarray
    block_tables: np.ndarray
    logit_rows: np.ndarray | None
    dp_linear: bool

    @property
    def num_tokens(self) -> int: ...


DECODE_MIN_BLOCKS = 2  # the narrowest decode block table (see build_attention_metadata)


@dataclass
class AttentionMetadata:
    """How one group of sequences attends (see `AttentionGroup` and `attention_ops`), built
    once per step for all layers.

    A decode group (one new token per sequence) attends in one call through its block tables,
    `key_mask` marking each sequence's keys. Fresh prompts of equal length attend in one causal
    call to their new keys (`equal_fresh`). Otherwise each sequence attends on its own: a fresh
    prompt to its new keys, a chunk after a cached prefix to the blocks that hold its keys (the
    step's new keys are written there first) under its own prefix-causal mask.
    """

    batch_size: int
    decode: bool
    equal_fresh: bool
    q_starts: list[int]  # each sequence's first token, relative to the group's first
    q_lens: list[int]
    kv_lens: list[int]
    device: torch.device
    block_tables: torch.Tensor | None = None  # decode: [B, blocks]
    key_mask: torch.Tensor | None = None  # decode: [B, 1, 1, blocks * block_size] bool
    seq_lens: torch.Tensor | None = None  # decode: [B] int64, = kv_lens
    key_blocks: list[torch.Tensor | None] | None = None  # prefill, per sequence; None: fresh
    masks: list[torch.Tensor | None] | None = None  # prefill, per sequence; None: fresh
    _windowed: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False)

    def windowed(self, window: int) -> AttentionMetadata:
        """The metadata for a sliding-window layer, whose queries see only the last `window`
        keys (their own included): this metadata where no sequence holds more keys than that,
        else a copy whose decode key mask and prefill masks leave out the older keys (every
        sequence then attends on its own, under its mask). Built once per step per window,
        for all layers of that window."""
        narrowed = self._windowed.get(window)
        if narrowed is None:
            narrowed = self._windowed[window] = self._narrowed(window)
        return narrowed

    def _narrowed(self, window: int) -> AttentionMetadata:
        if max(self.kv_lens) <= window:
            return self
        if self.decode:
            return replace(self, key_mask=sliding_key_mask(self.key_mask, self.seq_lens, window),
                           _windowed={})
        masks = [prefix_causal_mask(q, kv - q, self.device, window) if kv > window else mask
                 for q, kv, mask in zip(self.q_lens, self.kv_lens, self.masks)]
        return replace(self, equal_fresh=False, masks=masks, _windowed={})


@dataclass
class AttentionGroup:
    """Sequences that attend together: the step's tokens `tokens` and their metadata."""

    tokens: slice
    meta: AttentionMetadata


def build_attention_metadata(q_lens: np.ndarray, kv_lens: np.ndarray, block_tables: np.ndarray,
                             block_size: int, device: torch.device) -> AttentionMetadata:
    """The metadata of sequences that attend together (see `AttentionMetadata`)."""
    fresh = q_lens == kv_lens
    meta = AttentionMetadata(
        batch_size=len(q_lens), decode=bool((q_lens == 1).all()) and not fresh.all(),
        equal_fresh=bool(fresh.all()) and bool((q_lens == q_lens[0]).all()),
        q_starts=np.concatenate([[0], np.cumsum(q_lens)[:-1]]).tolist(),
        q_lens=q_lens.tolist(), kv_lens=kv_lens.tolist(), device=torch.device(device))
    blocks = -(-kv_lens // block_size)  # blocks holding each sequence's keys
    if meta.decode:
        # At least DECODE_MIN_BLOCKS wide (padded with block 0, masked): a compiled decode
        # step's graph has a symbolic width traced from 2, and a width of 1 would compile
        # another graph, a minute's stall, for every short prompt's first decode steps.
        width = max(int(blocks.max()), DECODE_MIN_BLOCKS)
        # Contiguous: a plan's tables wider than its keys need would give a strided slice,
        # which the compiled step's graph (traced on contiguous tables, called without guards)
        # rejects ("expected ... stride 11==9").
        tables = np.ascontiguousarray(block_tables[:, :width])
        if tables.shape[1] < width:
            tables = np.pad(tables, ((0, 0), (0, width - tables.shape[1])))
        meta.block_tables = torch.from_numpy(tables).to(device)
        key_mask = np.arange(width * block_size)[None, :] < kv_lens[:, None]
        meta.key_mask = torch.from_numpy(key_mask[:, None, None, :]).to(device)
        meta.seq_lens = torch.from_numpy(kv_lens.astype(np.int64)).to(device)
    else:
        meta.key_blocks = [None if is_fresh else torch.from_numpy(block_tables[b, :n]).to(device)
                           for b, (is_fresh, n) in enumerate(zip(fresh, blocks))]
        meta.masks = [None if is_fresh else prefix_causal_mask(int(q), int(kv - q), device)
                      for is_fresh, q, kv in zip(fresh, q_lens, kv_lens)]
    return meta


def build_attention_groups(plan: StepArrays, block_size: int,
                           device: torch.device) -> list[AttentionGroup]:
    """One group for the whole step, or two when decode rows (one query each) come first and
    prompt rows after, as the scheduler orders a mixed step: the decode rows then attend in one
    batched call instead of one by one with the prompts."""
    decodes = int(np.argmin(plan.q_lens == 1)) if (plan.q_lens > 1).any() else 0
    if decodes == 0 or (plan.q_lens[decodes:] == 1).any():
        cuts = [(0, len(plan.q_lens))]
    else:
        cuts = [(0, decodes), (decodes, len(plan.q_lens))]
    groups, start = [], 0
    for first, last in cuts:
        count = int(plan.q_lens[first:last].sum())
        groups.append(AttentionGroup(
            slice(start, start + count),
            build_attention_metadata(plan.q_lens[first:last], plan.kv_lens[first:last],
                                     plan.block_tables[first:last], block_size, device)))
        start += count
    return groups


class ForwardBatch:
    """A StepPlan as tensors on this rank's device, passed explicitly to every layer."""

    def __init__(self, plan: StepArrays, block_size: int, device: torch.device) -> None:
        self.num_tokens = plan.num_tokens
        self.input_ids = torch.from_numpy(plan.input_ids).to(device)
        self.positions = torch.from_numpy(plan.positions).to(device)
        self.slot_mapping = torch.from_numpy(plan.slot_mapping).to(device)
        self.attn_groups = build_attention_groups(plan, block_size, device)
        self.dp_linear = plan.mode.dp_linear
        # None where every token is a logit row (the rows ascend, so as many as the tokens
        # are all of them: every decode step): no index to apply, or to trace in a compiled
        # step (where one made inductor's C++ for the int8 LM head name an undefined size).
        every_row = plan.logit_rows is None or len(plan.logit_rows) == plan.num_tokens
        self.logits_index = (None if every_row
                             else torch.from_numpy(plan.logit_rows).to(device))
        # Embeddings: the tokens whose final hidden states are pooled, and the segment of each
        segments = getattr(plan, "pool_segments", None)
        self.pool_tokens = self.pool_ids = None
        self.num_pools = 0 if segments is None else len(segments)
        if segments is not None:
            lengths = segments[:, 1] - segments[:, 0]
            tokens = np.concatenate([np.arange(a, b) for a, b in segments])
            self.pool_tokens = torch.from_numpy(tokens).to(device)
            self.pool_ids = torch.from_numpy(np.repeat(np.arange(len(segments)), lengths)
                                             ).to(device)
