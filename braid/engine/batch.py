"""One forward step: the plan sent to every rank and the ForwardBatch built from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from braid.engine.request import TokenLogprob
from braid.layers.attention_ops import prefix_causal_mask


@dataclass
class Penalty:
    """A sampling row's repetition, presence and frequency penalties and the token history
    they apply to (repetition: prompt and output; presence and frequency: output only)."""

    repetition: float
    presence: float
    frequency: float
    prompt_ids: np.ndarray  # [P] int64, unique
    output_ids: np.ndarray  # [O] int64


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step (rank 0 samples), one row per sequence that
    gets a new token."""

    temperatures: np.ndarray  # [S] float32; 0 means greedy
    top_ks: np.ndarray  # [S] int64; 0 means no limit
    top_ps: np.ndarray  # [S] float32
    min_ps: np.ndarray  # [S] float32
    seeds: list[int | None]  # per-sequence seed, combined with the output position
    output_positions: np.ndarray  # [S] index of the token being sampled within its output
    num_logprobs: np.ndarray  # [S] int64: top alternatives to report, -1 for no logprobs
    scored_ids: list[tuple[int, ...]]  # tokens whose logprobs each row reports
    penalties: list[Penalty | None]
    banned: list[tuple[int, ...]]  # tokens that may not be sampled (EOS before min_tokens)
    biases: list[tuple[tuple[int, float], ...]]  # (token id, added to its logit) per row
    # Rows constrained by a grammar, ascending: their token bitmask ([G, ceil(vocab / 32)]
    # int32) reaches rank 0 after the plan, filled by the driver while the step runs.
    grammar_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass
class PromptLogprobRows:
    """Logit rows whose logprob of the next prompt token is reported (echo, scoring)."""

    rows: np.ndarray  # [P] indices into the step's logit rows
    targets: np.ndarray  # [P] the prompt token that follows each row's position
    num_logprobs: np.ndarray  # [P] top alternatives to report


@dataclass
class StepPlan:
    """One forward step, decided by the scheduler and sent to every rank.

    Tokens of all sequences are concatenated: sequence b contributes `q_lens[b]` new tokens and
    attends to `kv_lens[b]` tokens (its cached prefix plus the new ones). Logits are computed
    only at `logit_rows` (token indices, ascending; None: at every token); `sample_rows` picks
    from those the rows that get a new token.
    """

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: KV cache slot each new token writes
    q_lens: np.ndarray  # [B] int64
    kv_lens: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, max_blocks] int64, padded with 0
    logit_rows: np.ndarray | None = None  # [R] int64
    sample_rows: np.ndarray | None = None  # [S] int64 indices into the logit rows
    sampling: SamplingBatch | None = None
    prompt_logprobs: PromptLogprobRows | None = None
    step_id: int = 0  # rank 0's answer carries it back
    return_logits: bool = False  # send the fp32 logits of the logit rows back (validation)
    overlap: bool = False  # run as two overlapped micro-batches (the driver decides)
    skip_comm: bool = False  # collectives as no-ops for this step (timing only)
    dp_linear: bool = False  # replicated projections split over tokens (DataParallelLinear)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class StepResult:
    """Rank 0's answer to a step: the sampled token of each sampling row (None where sampling
    failed; `errors` says why, by row), logprobs where asked, the logits if asked, and the path
    the step took (`STEP_PATHS`)."""

    step_id: int
    tokens: list[int | None] | None = None
    errors: dict[int, str] | None = None
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    logits: torch.Tensor | None = None
    path: str = "eager"
    grammar_wait_s: float = 0.0  # how long rank 0 waited for the grammar mask


# How a step ran (`StepResult.path`, reported by benchmarks and `/metrics`): the decode graph,
# compiled pieces between eager attention calls, or eager; "+overlap" where two micro-batches
# were interleaved.
STEP_PATHS = ("graph", "pieces", "eager", "pieces+overlap", "eager+overlap")


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
    block_tables: torch.Tensor | None = None  # decode: [B, blocks]
    key_mask: torch.Tensor | None = None  # decode: [B, 1, 1, blocks * block_size] bool
    seq_lens: torch.Tensor | None = None  # decode: [B] int64, = kv_lens
    key_blocks: list[torch.Tensor | None] | None = None  # prefill, per sequence; None: fresh
    masks: list[torch.Tensor | None] | None = None  # prefill, per sequence; None: fresh


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
        q_lens=q_lens.tolist(), kv_lens=kv_lens.tolist())
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


def build_attention_groups(plan: StepPlan, block_size: int,
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

    def __init__(self, plan: StepPlan, block_size: int, device: torch.device) -> None:
        self.num_tokens = plan.num_tokens
        self.input_ids = torch.from_numpy(plan.input_ids).to(device)
        self.positions = torch.from_numpy(plan.positions).to(device)
        self.slot_mapping = torch.from_numpy(plan.slot_mapping).to(device)
        self.attn_groups = build_attention_groups(plan, block_size, device)
        self.dp_linear = plan.dp_linear
        # None where every token is a logit row (the rows ascend, so as many as the tokens
        # are all of them: every decode step): no index to apply, or to trace in a compiled
        # step (where one made inductor's C++ for the int8 LM head name an undefined size).
        every_row = plan.logit_rows is None or len(plan.logit_rows) == plan.num_tokens
        self.logits_index = (None if every_row
                             else torch.from_numpy(plan.logit_rows).to(device))
