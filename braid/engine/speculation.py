"""Speculative decoding on the driver: which tokens each decoding sequence proposes for the
next step, and whether proposing pays at all.

A sequence's draft is verified by the next step as extra decode rows (`plan.build_plan`) and
accepted by the scheduler (`Scheduler._record_tokens`); this module only proposes.

- **Proposers.** `ngram` (prompt lookup, as vLLM's `ngram` and llama.cpp's lookup decoding):
  the latest earlier occurrence of the sequence's last n tokens (n from `ngram_max` down to
  `ngram_min`) in its own prompt and output, and the tokens that followed it there. `mtp`:
  the token DeepSeek-V3's multi-token-prediction layer computed in the ranks with the step
  that sampled the sequence's newest token (`braid.worker.mtp`). `draft`: `engine/draft.py`.
- **Policy.** Each sequence keeps a recent acceptance rate `a` (the accepted share of its drafts,
  averaged with decay, so one long rejected draft does not silence a sequence that copies): a
  draft of d tokens is expected to add a * d. (Copying is all or nothing: a draft that matches the
  text being copied is accepted whole, one from the wrong place is not, so the expected run grows
  with d as the share of whole acceptances does; a geometric model, a^1 + ... + a^d, undervalued
  long drafts on copy-heavy text and chose ones half as long.) A step's time is a line in its row
  count (`StepTimes`, fitted to the medians of the latest decode steps of each count; neighbouring
  medians are too noisy to difference: a step of 34 rows came out faster than one of 32). Before a
  step, every candidate depth cap d is weighed: the tokens the step is expected to yield (one per
  sequence, plus a * min(d, its draft)) over the fitted time of a step of that many rows; the best
  cap applies (weighed first for drafts as long as asked, and the proposer asked for no
  more, so a draft model does not draft what no step pays for; then again for the drafts'
  real lengths). At small batch a row is almost free (the weights are read once either way), at
  large batch on a compute-bound host rows cost what tokens are worth and speculation switches
  itself off. With one count timed, a count up to twice it is assumed to cost the same (beyond, in
  proportion), so it is tried, timed, and from then on weighed; the timings age out of the
  window, so a choice is re-probed as the load changes. The window outlasts the launch: it is
  kept in braid's cache per model, settings and host (`step_times_file`), with a draft
  model's, so a new server weighs its first drafts by the times measured before instead of
  trying them. A new sequence starts from the rate of the sequences before it (a new
  random-text request does not propose 16 tokens just to learn it should not), and a
  sequence, like that shared rate, drifts back toward 0.5 while it does not propose, so text
  that turns repetitive later is tried again.
- **A draft model** (`DraftCosts`) also costs its forwards: one per level of depth, each a
  line in its rows as the model's steps are (the sequences still proposing at that level),
  and a catch-up of the tokens it has not computed (a prompt, the first time), per token. So
  a sequence behind proposes only where that catch-up costs less than drafting is expected to
  save it over the tokens it has left, at the saving per token of the batch's best depth: a
  long output repays reading its prompt, a short one in a full batch does not. Before the
  draft's forwards are timed only one sequence explores (the one least behind, one token
  deep), so a fresh server does not pay a catch-up of every prompt in its first batch.
- **A ledger per sequence.** The expectation can be wrong for one request (its drafts accepted
  less than its rate says, its rows dearer than the line), so each sequence also keeps what its
  verified drafts earned and cost, in seconds: its accepted tokens at the plain cost of a
  token in that step's batch (the fitted time of the step without drafts, over its
  sequences), against the step's measured time less the fitted time of the step without its
  draft rows. A sequence whose last `LEDGER_DRAFTS` drafts cost more than they earned stops
  proposing for `PAUSE_STEPS` steps, twice as long each time it loses again: a request that
  speculation slows is decoded plainly, at most a few drafts' cost per pause.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from braid.cache import (
    CacheWarning,
    cache_root,
    code_version,
    model_identity,
    replace_atomically,
)
from braid.config import EngineConfig
from braid.engine.draft import DECODE_SHAPED_CATCH_UP
from braid.engine.request import Sequence
from braid.platform import isa_flags, usable_cores
from braid.step import DraftPlan

PRIOR_RATE = 0.5  # the acceptance rate before any draft was verified
DECAY = 0.8  # per verified step: the rate follows the last few steps' text
IDLE_DECAY = 0.998  # per step without a draft: from 0.02 back to MIN_ACCEPTANCE in ~30 steps
TRAFFIC_DECAY = 0.98  # per sequence's verified draft: the traffic's rate, over ~50 drafts
MIN_ACCEPTANCE = 0.05  # below this a sequence proposes nothing (also when rows are free)
TIMES_WINDOW = 256  # latest decode steps whose times `StepTimes` keeps
# Timings a row count needs before it is weighed: its first step may pay for the GEMM
# library's kernels for that shape (tens of ms), which alone would rule it out for good
MIN_TIMINGS = 3
DRAFT_WINDOW = 16  # latest catch-ups of a draft model whose seconds per token are kept
LEDGER_DRAFTS = 8  # verified drafts of a sequence between two judgements of its ledger
PAUSE_STEPS = 16  # steps a losing sequence proposes nothing, doubled at each loss ...
MAX_PAUSE_STEPS = 1024  # ... up to this


class Proposer(Protocol):
    """Proposes up to k tokens to follow each sequence's tokens."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]: ...


@dataclass
class NgramIndex:
    """Where each n-gram of a sequence's tokens (n in [n_min, n_max]) last occurred with a
    token after it: n-gram -> index of that next token. Grown as the sequence grows."""

    n_min: int
    n_max: int
    tokens: list[int] = field(default_factory=list)
    next_of: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, seq: Sequence) -> None:
        """Take in the sequence's tokens appended since the last call."""
        old = len(self.tokens)
        self.tokens += seq.token_slice(old, seq.num_tokens)
        tokens, next_of = self.tokens, self.next_of
        for end in range(max(old, 1), len(tokens)):  # n-grams ending before token `end`
            for n in range(self.n_min, min(self.n_max, end) + 1):
                next_of[tuple(tokens[end - n:end])] = end

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        found (none: no suffix of at least n_min tokens occurred before)."""
        tokens = self.tokens
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            start = self.next_of.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class NgramProposer:
    """Prompt lookup in each sequence's own tokens (see the module docstring)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, ks):
            state = seq.speculation
            if state.index is None:
                state.index = NgramIndex(self.n_min, self.n_max)
            state.index.extend(seq)
            drafts.append(state.index.lookup(k) if k else [])
        return drafts


class LayerProposals:
    """`mtp`: the token the ranks' multi-token-prediction layer proposed to follow each
    sequence's newest token (`StepResult.proposals`), handed over by the step that sampled
    that token and valid for the next step only."""

    def __init__(self) -> None:
        self._next: dict[int, tuple[int, int]] = {}  # seq_id -> (its tokens then, proposal)

    def receive(self, batch: list[Sequence], layout: list, proposals: list[int] | None) -> None:
        """A step's proposals, after its tokens were committed (`layout`: the step's
        `SequenceRows`, whose sampling runs the proposals follow)."""
        sampled = [seq for seq, rows in zip(batch, layout) if rows.sample_row is not None]
        self._next = {seq.seq_id: (seq.num_tokens, token)
                      for seq, token in zip(sampled, proposals or [])}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, ks):
            tokens_then, token = self._next.get(seq.seq_id, (None, None))
            drafts.append([token] if k and tokens_then == seq.num_tokens else [])
        return drafts


@dataclass
class AcceptanceRate:
    """The accepted share of drafts, averaged with decay: a sequence's, or the traffic's."""

    rate: float = PRIOR_RATE

    def add(self, accepted: int, proposed: int, decay: float) -> None:
        self.rate = decay * self.rate + (1 - decay) * accepted / proposed

    def relax(self) -> None:
        """A step without a verified draft: a little back toward the prior."""
        self.rate = IDLE_DECAY * self.rate + (1 - IDLE_DECAY) * PRIOR_RATE

    def copy(self) -> AcceptanceRate:
        return AcceptanceRate(self.rate)


@dataclass
class Ledger:
    """What a sequence's latest verified drafts earned and cost, in seconds, and how long it
    proposes nothing after losing (see the module docstring)."""

    earned: float = 0.0
    spent: float = 0.0
    drafts: int = 0
    paused: int = 0  # steps left without a proposal
    next_pause: int = PAUSE_STEPS

    def record(self, earned: float, spent: float) -> None:
        """One verified draft; after `LEDGER_DRAFTS`, a pause where they cost more than they
        earned."""
        self.earned += earned
        self.spent += spent
        self.drafts += 1
        if self.drafts >= LEDGER_DRAFTS:
            if self.spent > self.earned:
                self.paused = self.next_pause
                self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
            self.earned = self.spent = 0.0
            self.drafts = 0


@dataclass
class SequenceSpeculation:
    """One sequence's speculation state: its acceptance rate, its ledger, the draft it
    proposed last and its length then (to learn how much was accepted), and the proposer's own
    state (an `NgramIndex`)."""

    acceptance: AcceptanceRate
    ledger: Ledger = field(default_factory=Ledger)
    proposed: int = 0
    tokens_then: int = 0
    index: NgramIndex | None = None

    def learn(self, num_tokens: int) -> int | None:
        """How much of the last draft was accepted, now that the sequence has `num_tokens`
        tokens (None: it proposed nothing, or its draft was not verified, its sequence
        preempted), counted in its rate."""
        accepted = None
        if self.proposed and num_tokens > self.tokens_then:
            accepted = min(num_tokens - self.tokens_then - 1, self.proposed)
            self.acceptance.add(accepted, self.proposed, DECAY)
        elif not self.proposed:
            self.acceptance.relax()
        self.proposed = 0
        return accepted


class StepTimes:
    """Decode step time as a line in the row count, fitted to the medians of the counts timed
    at least `MIN_TIMINGS` times over the latest `TIMES_WINDOW` decode steps (`saved`: a
    previous launch's, `samples()`, which the new steps then replace)."""

    def __init__(self, saved: Iterable[tuple[int, float]] = ()) -> None:
        self._steps: deque[tuple[int, float]] = deque(saved, maxlen=TIMES_WINDOW)
        self._line: tuple[float, float, float | None] | None = None  # `_fit`'s
        self._new = len(self._steps)  # steps timed since the line was fitted

    def observe(self, rows: int, seconds: float) -> None:
        self._steps.append((rows, seconds))
        self._new += 1

    def samples(self) -> list[tuple[int, float]]:
        """The timed steps in the window, oldest first: (rows, seconds)."""
        return list(self._steps)

    def estimate(self, rows: np.ndarray) -> np.ndarray | None:
        """Expected seconds of a step of each row count (None before a count was timed
        enough): the fitted line, never falling with more rows (with one count timed: its
        time up to twice its count, in proportion beyond)."""
        if self._new >= 16 or (self._line is None and self._new):
            self._new = 0
            by_rows: dict[int, list[float]] = {}
            for count, seconds in self._steps:
                by_rows.setdefault(count, []).append(seconds)
            counts = sorted(c for c, times in by_rows.items() if len(times) >= MIN_TIMINGS)
            self._line = self._fit(np.array(counts, dtype=np.float64),
                                   np.array([np.median(by_rows[c]) for c in counts]))
        if self._line is None:
            return None
        base, slope, explored = self._line
        if explored is not None:  # one count timed
            return base * np.maximum(1.0, rows / (2 * explored))
        return base + slope * rows

    @staticmethod
    def _fit(counts: np.ndarray, times: np.ndarray) -> tuple[float, float, float | None] | None:
        """(base, slope, the one count timed or None) of the medians by row count."""
        if len(counts) == 0:
            return None
        if len(counts) == 1:
            return float(times[0]), 0.0, float(counts[0])
        slope, base = np.polyfit(counts, times, 1)
        if slope < 0:
            return float(times.mean()), 0.0, None
        return float(base), float(slope), None


class DraftCosts:
    """What a draft model's forwards cost, from its timed steps: a forward of decode rows (one
    per proposing sequence at a level of depth, or per token of a short catch-up) as a line in
    its rows, as the model's steps are (`StepTimes`), and a longer catch-up (a prompt the
    draft has not seen) by its seconds per token. `saved`: `samples()` of a previous launch."""

    def __init__(self, saved: dict | None = None) -> None:
        saved = saved or {}
        self.forwards = StepTimes(saved.get("forwards", ()))
        self._catch_up: deque[float] = deque(saved.get("catch_up", ()), maxlen=DRAFT_WINDOW)

    def observe(self, rows: list[int], seconds: list[float], short_catch_up: bool) -> None:
        """A step's draft forwards: their rows and seconds, the catch-up's first (decode rows
        where `short_catch_up`)."""
        if not short_catch_up:
            self._catch_up.append(seconds[0] / rows[0])
            rows, seconds = rows[1:], seconds[1:]
        for count, forward_seconds in zip(rows, seconds):
            self.forwards.observe(count, forward_seconds)

    def depth_seconds(self, first_rows: int, lengths: np.ndarray) -> np.ndarray | None:
        """Seconds of the draft's forwards at each depth cap 0, 1, ... max(lengths) for
        sequences proposing `lengths` tokens, `first_rows` rows in the first forward (None
        before a count of rows was timed enough)."""
        levels = np.arange(1, int(lengths.max(initial=0)) + 1)
        rows = (lengths[None, :] >= levels[:, None]).sum(axis=1)
        rows[:1] = np.maximum(rows[:1], first_rows)
        seconds = self.forwards.estimate(rows)
        return None if seconds is None else np.concatenate([[0.0], np.cumsum(seconds)])

    def catch_up_seconds(self, tokens: np.ndarray) -> np.ndarray | None:
        """Expected seconds of catch-ups of `tokens` tokens each: per token as the latest
        ones, or, before one was timed, as a forward of that many decode rows (None:
        neither)."""
        if self._catch_up:
            return tokens * float(np.median(self._catch_up))
        return self.forwards.estimate(tokens.astype(np.float64))

    def samples(self) -> dict:
        """The timings to keep for the next launch (`saved`)."""
        return {"forwards": self.forwards.samples(), "catch_up": list(self._catch_up)}


class Speculator:
    """Sets each decoding sequence's draft before the scheduler plans a step. `times_file`:
    where the step times are kept between launches (`step_times_file`), so that a new server
    weighs its first drafts by what it measured before instead of trying long ones."""

    def __init__(self, proposer: Proposer, max_tokens: int,
                 times_file: Path | None = None, draft_model: bool = False) -> None:
        self.proposer = proposer
        self.max_tokens = max_tokens
        self.times_file = times_file
        saved = load_saved_times(times_file) if times_file else {}
        self.times = StepTimes(saved.get("steps", ()))
        # A draft model's proposals also cost its forwards, and its catch-up of the tokens it
        # has not computed (the proposer then tells them: `RankDraftProposer.behind`)
        self.draft = DraftCosts(saved.get("draft")) if draft_model else None
        self.traffic = AcceptanceRate()  # every sequence's verified proposals
        self._drafted = 0  # draft rows of the step last proposed for
        self._last_step: tuple[int, float] | None = None  # its rows and seconds, once timed

    def propose(self, decoding: list[Sequence]) -> None:
        """Drafts for the sequences about to decode (none where speculation does not pay, or
        cannot apply: a grammar constrains the sequence, or it is about to end)."""
        seqs, ks = [], []
        verified = False
        costs = self._last_step_costs()
        for seq in decoding:
            if seq.speculation is None:
                seq.speculation = SequenceSpeculation(self.traffic.copy())
            state = seq.speculation
            proposed = state.proposed
            accepted = state.learn(seq.num_tokens)
            if accepted is not None:
                self.traffic.add(accepted, proposed, TRAFFIC_DECAY)
                verified = True
                if costs is not None:
                    token_seconds, step_seconds, fitted = costs
                    state.ledger.record(accepted * token_seconds,
                                        max(0.0, step_seconds - fitted(proposed)))
            seq.draft = []
            if state.ledger.paused:
                state.ledger.paused -= 1
                continue
            room = min(seq.params.max_new_tokens - len(seq.output_ids) - 1, self.max_tokens)
            if seq.grammar is None and room > 0 and state.acceptance.rate >= MIN_ACCEPTANCE:
                seqs.append(seq)
                ks.append(room)
        if not verified:
            self.traffic.relax()
        first_rows = 0
        if self.draft is not None:
            seqs, ks, first_rows = self._drafted_by_model(len(decoding), seqs, ks)
        rates = [s.speculation.acceptance.rate for s in seqs]
        # The cap as if every draft were as long as asked, before drafting: a costly proposer
        # (a draft model) drafts no deeper than a step can pay for, or not at all
        most = self._best_cap(len(decoding), rates, ks, first_rows)
        drafts = self.proposer.propose(seqs, [min(k, most) for k in ks])  # also when empty:
        cap = self._best_cap(len(decoding), rates, [len(d) for d in drafts],  # it frees state
                             first_rows)
        for seq, draft in zip(seqs, drafts):
            seq.draft = draft[:cap]
            seq.speculation.proposed = len(seq.draft)
            seq.speculation.tokens_then = seq.num_tokens
        self._drafted = sum(len(seq.draft) for seq in seqs)

    def _last_step_costs(self):
        """For the ledgers, where the step last proposed for was a timed decode step and the
        times are fitted: the plain cost of one of its tokens (the fitted time of its rows
        without drafts, over its sequences), its measured seconds, and the fitted seconds of
        the step less a number of draft rows."""
        last, self._last_step = self._last_step, None
        if last is None or not self._drafted:
            return None
        rows, seconds = last
        plain = rows - self._drafted
        fitted = self.times.estimate(np.array([plain, rows], dtype=np.float64))
        if fitted is None or plain < 1:
            return None
        base, slope_rows = fitted[0], fitted[1] - fitted[0]
        per_row = slope_rows / self._drafted
        return base / plain, seconds, lambda drafted: fitted[1] - per_row * drafted

    def _drafted_by_model(self, num_decoding: int, seqs: list[Sequence], ks: list[int]
                          ) -> tuple[list[Sequence], list[int], int]:
        """Which of `seqs` a draft model proposes for, how deep at most, and the rows of its
        first forward: none before plain steps are timed; then the one least behind, one
        token deep, until the draft's forwards are; then each sequence caught up, and each
        one behind whose catch-up costs less than drafting is expected to save it over the
        tokens it has left (at the saving per token of this batch's best depth)."""
        plain = self.times.estimate(np.array([num_decoding], dtype=np.float64))
        if plain is None or not seqs:
            return [], [], 0
        behind = np.array([self.proposer.behind(seq) for seq in seqs])
        if self.draft.forwards.estimate(np.ones(1)) is None:
            first = int(np.argmin(behind))
            return [seqs[first]], [1], 1
        # A few tokens are decode rows of the first forward; a longer catch-up costs its own
        short = np.clip(behind, 1, DECODE_SHAPED_CATCH_UP)
        yields = self._yields(num_decoding, [seq.speculation.acceptance.rate for seq in seqs],
                              ks, int(short.sum()))
        saved_per_token = plain[0] / num_decoding * (1 - yields[0] / yields.max())
        left = np.array([seq.params.max_new_tokens - len(seq.output_ids) for seq in seqs])
        kept = np.flatnonzero((behind <= DECODE_SHAPED_CATCH_UP)
                              | (self.draft.catch_up_seconds(behind) < saved_per_token * left))
        return [seqs[i] for i in kept], [ks[i] for i in kept], int(short[kept].sum())

    def _yields(self, num_decoding: int, rates: list[float], lengths: list[int],
                first_rows: int = 0) -> np.ndarray | None:
        """The tokens per second a step is expected to yield at each depth cap 0, 1, ... the
        longest draft (`first_rows`: a draft model's first forward's; None before the step's
        row counts, or a draft model's forwards, are timed)."""
        lengths = np.array(lengths, dtype=np.int64)
        caps = np.arange(int(lengths.max(initial=0)) + 1)
        depths = np.minimum(lengths[None, :], caps[:, None])  # [cap, sequence]
        seconds = self.times.estimate(num_decoding + depths.sum(axis=1))
        if seconds is not None and self.draft is not None:
            drafting = self.draft.depth_seconds(first_rows, lengths)
            seconds = None if drafting is None else seconds + drafting
        if seconds is None:
            return None
        tokens = num_decoding + depths @ np.array(rates, dtype=np.float64)
        return tokens / np.maximum(seconds, 1e-9)

    def _best_cap(self, num_decoding: int, rates: list[float], lengths: list[int],
                  first_rows: int = 0) -> int:
        """The depth cap whose step yields the most tokens per measured second (before the
        times are known: the longest draft, or for a draft model one token)."""
        longest = max(lengths, default=0)
        if longest == 0:
            return 0
        yields = self._yields(num_decoding, rates, lengths, first_rows)
        if yields is None:
            return longest if self.draft is None else 1
        return int(np.argmax(yields))

    def observe_step(self, rows: int, seconds: float, draft_seconds: float = 0.0) -> None:
        """A decode step of `rows` rows (sequences plus draft tokens) took `seconds`, of which
        a draft model's forwards took `draft_seconds` (the step-time line fits the rest; the
        ledgers are charged the whole)."""
        self.times.observe(rows, seconds - draft_seconds)
        self._last_step = rows, seconds

    def observe_draft(self, plan: DraftPlan, seconds: list[float]) -> None:
        """A step's draft model forwards (`DraftPlan.forward_rows`) took `seconds` each."""
        if self.draft is not None:
            self.draft.observe(plan.forward_rows(), seconds,
                               short_catch_up=bool((plan.catch_up.q_lens == 1).all()))

    def save(self) -> None:
        """Keep the step times in `times_file` for the next launch (a warning if it cannot)."""
        if self.times_file is None or not self.times.samples():
            return
        saved = {"steps": self.times.samples()}
        if self.draft is not None:
            saved["draft"] = self.draft.samples()
        text = json.dumps(saved)
        try:
            replace_atomically(self.times_file, lambda tmp: tmp.write_text(text))
        except OSError as e:
            warnings.warn(f"speculation: cannot keep the step times in {self.times_file}: {e}",
                          CacheWarning, stacklevel=2)


def step_times_file(config: EngineConfig) -> Path:
    """Where a launch with these settings keeps its decode step times on this host: keyed by
    everything that sets a step's time (braid's code, torch, the CPU and its threads, the
    model's file or files, every engine setting)."""
    identity = {"braid": code_version(), "torch": torch.__version__, "isa": isa_flags(),
                "cores": len(usable_cores()), "model": model_identity(config.model),
                "settings": asdict(config)}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
    return cache_root() / "speculation" / f"{key.hexdigest()[:24]}.json"


def load_saved_times(path: Path) -> dict:
    """A launch's saved times (`Speculator.save`): {"steps": [(rows, seconds), ...], "draft":
    `DraftCosts.samples()`}; none where there is no file or it does not read as one."""
    def pairs(samples: list) -> list[tuple[int, float]]:
        return [(int(rows), float(seconds)) for rows, seconds in samples]

    try:
        saved = json.loads(path.read_text())
        draft = saved.get("draft", {})
        return {"steps": pairs(saved["steps"]),
                "draft": {"forwards": pairs(draft.get("forwards", [])),
                          "catch_up": [float(seconds) for seconds in draft.get("catch_up", [])]}}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}
