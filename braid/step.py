"""The wire types between braid's processes, named by what they carry:

- `StepPlan`: one forward step, from the driver's scheduler to every rank (each builds a
  `braid.layers.forward_batch.ForwardBatch` from it);
- `StepResult`: rank 0's answer (sampled tokens, logprobs, the path the step took);
- `RankReady`: each rank's answer to "ready";
- `SequenceDelta`: what a step did for one sequence, from the engine core to the front ends
  (`braid.frontend`, the server's API process).

This module is the floor: it imports nothing of braid, so every process may read it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob, the `top` alternatives (token id, logprob), most likely first, the
    logprobs of the tokens a request named (`scored`, in its order), and the token's rank in
    the vocabulary (1: the most likely)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    scored: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


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


@dataclass(frozen=True)
class StepMode:
    """How the ranks run one step, as the driver decided it from the per-step switches
    (`braid.config.StepSwitches`) and, where they are `auto`, from what it learned
    (`braid.engine.step_choice`)."""

    overlap: bool = False  # as two overlapped micro-batches
    dp_linear: bool = False  # replicated projections split over tokens (DataParallelLinear)
    comm_compression: str = "none"  # how partial sums travel (`braid.distributed.compression`)
    skip_comm: bool = False  # collectives as no-ops (timing only)
    choice: str = ""  # why, where `auto` chose (for the trace)


@dataclass
class DraftPlan:
    """`--speculative draft`: the draft model's part of a step, run on the ranks before the
    model's forward (`braid.worker.draft`). `catch_up` computes the draft's keys for the
    tokens it has not computed of each sequence that proposes (up to its newest) or catches up
    without proposing (a chunk); the argmax of its logits at `proposers[i]` (indices into its
    logit rows) is proposing sequence i's first token.
    Sequence i verifies its draft at the step's rows `rows[i]` (its last token) to
    `rows[i] + lengths[i]`: the ranks fill those input ids with the draft's greedy tokens, one
    draft step per token, at those rows' positions and slots."""

    catch_up: StepPlan
    proposers: np.ndarray  # [P] int64: each proposing sequence's row of the catch-up's logits
    rows: np.ndarray  # [P] int64: each proposing sequence's last-token row in the step's plan
    lengths: np.ndarray  # [P] int64: the tokens it proposes (>= 1)

    def forward_rows(self) -> list[int]:
        """The rows of each of the draft's forwards: the catch-up's tokens, then one per
        sequence proposing a further token, for each level of depth."""
        levels = np.arange(2, int(self.lengths.max(initial=0)) + 1)
        return [self.catch_up.num_tokens] + [int((self.lengths >= d).sum()) for d in levels]


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
    # [G] int64: the sampling rows of each sequence that samples, consecutive (1 + its draft)
    sample_runs: np.ndarray | None = None
    sampling: SamplingBatch | None = None
    prompt_logprobs: PromptLogprobRows | None = None
    # Embeddings: [P, 2] token ranges [start, end) whose final hidden states are summed
    pool_segments: np.ndarray | None = None
    step_id: int = 0  # rank 0's answer carries it back
    return_logits: bool = False  # send the fp32 logits of the logit rows back (validation)
    mode: StepMode = field(default_factory=StepMode)
    draft: DraftPlan | None = None  # `--speculative draft`: proposals the ranks fill in

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


# The error of a sampling row whose request's own constraints (grammar, logit_bias,
# min_tokens) leave no token: the client's error (400), not the server's
NO_TOKEN_ALLOWED = ("no token is allowed (the grammar, logit_bias and min_tokens exclude every "
                    "token)")


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
    pooled: np.ndarray | None = None  # [P, hidden] fp32: the sums of the plan's pool segments
    path: str = "eager"
    grammar_wait_s: float = 0.0  # how long rank 0 waited for the grammar mask
    # `--speculative mtp`: the token proposed to follow each sampling run's accepted tokens
    # (`StepPlan.sample_runs`), by the model's MTP layer
    proposals: list[int] | None = None
    # `--speculative draft`: the tokens the draft proposed for each of `StepPlan.draft`'s
    # sequences, which this step verified
    drafts: list[list[int]] | None = None
    # ... and the seconds of each of the draft model's forwards (`DraftPlan.forward_rows`)
    draft_seconds: list[float] = field(default_factory=list)


# How a step ran (`StepResult.path`, reported by benchmarks and `/metrics`): the decode graph,
# compiled pieces between eager attention calls, or eager; "+overlap" where two micro-batches
# were interleaved.
STEP_PATHS = ("graph", "pieces", "eager", "pieces+overlap", "eager+overlap")


@dataclass
class SequenceDelta:
    """What one step did for one sequence: new tokens (with logprobs if asked), or the end.

    `finish_reason` is "stop" (EOS, a stop token, a stop string or a complete grammar),
    "length", "abort" or "error" (then `error` says why); `stop_reason` is the stop token id or
    string; `by_stop_token`: the last new token is the EOS or stop token that ended the
    sequence (not part of the text).
    `prompt_logprobs` arrive once, with the first generated token.
    """

    request_id: str
    index: int
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    by_stop_token: bool = False
    error: str | None = None
    invalid: bool = False  # the error is the request's own (`NO_TOKEN_ALLOWED`): a 400
    param: str | None = None  # where invalid: the request field at fault, if one is
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    embedding: np.ndarray | None = None  # a pooling request's vector (fp32, not normalised)


@dataclass(frozen=True)
class RankReady:
    """A rank's answer to "ready": why its steps cannot be compiled (None: they can), whether
    its decode graphs are saved (a warm start loads them in seconds), its kernel plan in a
    line (`KernelPlan.describe`) and its memory."""

    not_compiled: str | None
    cached: bool
    kernels: str = ""
    # What the rank holds (`braid.worker.memory`), and its process, whose memory a benchmark
    # samples
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    pid: int = 0
    namespace: str = ""  # `platform.process_namespace`: where `pid` can be looked up
    # Whether compiled steps run decode steps through the decode graph (not where the model
    # also outputs its hidden states: those run pieces)
    decode_graph: bool = False
