"""Speculative decoding on the driver: which tokens each decoding sequence proposes for the
next step, and whether proposing pays at all.

A sequence's draft is verified by the next step as extra decode rows (`plan.build_plan`) and
accepted by the scheduler (`Scheduler._record_tokens`); this module only proposes.

- **Proposers.** `ngram` (prompt lookup, as vLLM's `ngram` and llama.cpp's lookup decoding):
  the latest earlier occurrence of the sequence's last n tokens (n from `ngram_max` down to
  `ngram_min`) in its own prompt and output, and the tokens that followed it there.
- **Policy.** Each sequence keeps a recent acceptance rate `a` (accepted over proposed
  tokens, decayed, starting from a prior): a draft of d tokens is expected to add a * d.
  (Copying is all or nothing: a draft that matches the text being copied is accepted whole,
  one from the wrong place is not, so the expected run grows with d as the share of whole
  acceptances does; a geometric model, a^1 + ... + a^d, undervalued long drafts on
  copy-heavy text and chose ones half as long.) Each step's time is measured by its row
  count (`StepTimes`: the median of the latest decode steps of each count). Before a step,
  every candidate depth cap d is weighed: the tokens the step is expected to yield (one per
  sequence, plus a * min(d, its draft)) over the measured (interpolated) time of a step of
  that many rows; the best cap applies. At small batch a row is almost free (the weights are read
  once either way), at large batch on a compute-bound host rows cost what tokens are worth
  and speculation switches itself off. Beyond the largest timed row count, a step's time
  grows by the slope fitted over the timed counts; with one count timed, a count up to twice
  it is assumed to cost the same (beyond, in proportion), so it is tried, timed, and from
  then on weighed. The timings age out of the window, so a choice is re-probed as the load
  changes.
  A sequence whose rate fell too low to propose drifts back toward the prior while it does
  not propose, so text that turns repetitive later is tried again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from braid.engine.request import Sequence

# A new sequence's acceptance rate, 0.5, as the counts of two proposed tokens
PRIOR_ACCEPTED, PRIOR_PROPOSED = 1.0, 2.0
DECAY = 0.8  # per verified step: the rate follows the last few steps' text
IDLE_DECAY = 0.99  # per step without a proposal: back toward the prior in about 100 steps
MIN_ACCEPTANCE = 0.05  # below this a sequence proposes nothing (also when rows are free)
TIMES_WINDOW = 256  # latest decode steps whose times `StepTimes` keeps
# Timings a row count needs before it is weighed: its first step may pay for the GEMM
# library's kernels for that shape (tens of ms), which alone would rule it out for good
MIN_TIMINGS = 3


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


@dataclass
class SequenceSpeculation:
    """One sequence's speculation state: its acceptance rate's decayed counts, the draft it
    proposed last and its length then (to learn how much was accepted), and the proposer's
    own state (an `NgramIndex`)."""

    accepted: float = PRIOR_ACCEPTED
    proposals: float = PRIOR_PROPOSED
    proposed: int = 0
    tokens_then: int = 0
    index: NgramIndex | None = None

    @property
    def rate(self) -> float:
        return self.accepted / self.proposals

    def learn(self, num_tokens: int) -> None:
        """Count how much of the last draft was accepted, now that the sequence has
        `num_tokens` tokens (a draft not verified, its sequence preempted, counts nothing)."""
        if self.proposed and num_tokens > self.tokens_then:
            accepted = min(num_tokens - self.tokens_then - 1, self.proposed)
            self.accepted = DECAY * self.accepted + accepted
            self.proposals = DECAY * self.proposals + self.proposed
        elif not self.proposed:
            self.accepted = IDLE_DECAY * self.accepted + (1 - IDLE_DECAY) * PRIOR_ACCEPTED
            self.proposals = IDLE_DECAY * self.proposals + (1 - IDLE_DECAY) * PRIOR_PROPOSED
        self.proposed = 0


class StepTimes:
    """Decode step times by row count: the median of each count timed at least
    `MIN_TIMINGS` times over the latest `TIMES_WINDOW` decode steps, interpolated between
    counts."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=TIMES_WINDOW)
        self._medians: tuple[np.ndarray, np.ndarray] | None = None
        self._new = 0  # steps timed since the medians were taken

    def observe(self, rows: int, seconds: float) -> None:
        self._steps.append((rows, seconds))
        self._new += 1

    def estimate(self, rows: np.ndarray) -> np.ndarray | None:
        """Expected seconds of a step of each row count (None before a count was timed
        enough): linear between timed counts, below them the smallest one's time, above them
        the largest one's time plus the fitted slope (with one count timed: its time up to
        twice its count, in proportion beyond)."""
        if self._new >= 16 or (self._medians is None and self._new):
            self._new = 0
            by_rows: dict[int, list[float]] = {}
            for count, seconds in self._steps:
                by_rows.setdefault(count, []).append(seconds)
            counts = sorted(c for c, times in by_rows.items() if len(times) >= MIN_TIMINGS)
            self._medians = (np.array(counts, dtype=np.float64),
                             np.array([np.median(by_rows[c]) for c in counts])) if counts else None
        if self._medians is None:
            return None
        counts, times = self._medians
        if len(counts) == 1:
            return times[0] * np.maximum(1.0, rows / (2 * counts[0]))
        slope = max(0.0, float(np.polyfit(counts, times, 1)[0]))
        return np.interp(rows, counts, times) + slope * np.maximum(0, rows - counts[-1])


class Speculator:
    """Sets each decoding sequence's draft before the scheduler plans a step."""

    def __init__(self, proposer: Proposer, max_tokens: int) -> None:
        self.proposer = proposer
        self.max_tokens = max_tokens
        self.times = StepTimes()

    def propose(self, decoding: list[Sequence]) -> None:
        """Drafts for the sequences about to decode (none where speculation does not pay, or
        cannot apply: a grammar constrains the sequence, or it is about to end)."""
        seqs, ks = [], []
        for seq in decoding:
            if seq.speculation is None:
                seq.speculation = SequenceSpeculation()
            state = seq.speculation
            state.learn(seq.num_tokens)
            seq.draft = []
            room = min(seq.params.max_new_tokens - len(seq.output_ids) - 1, self.max_tokens)
            if seq.grammar is None and room > 0 and state.rate >= MIN_ACCEPTANCE:
                seqs.append(seq)
                ks.append(room)
        drafts = self.proposer.propose(seqs, ks)  # also when empty: it may free state
        cap = self._best_cap(len(decoding), [s.speculation.rate for s in seqs],
                             [len(d) for d in drafts])
        for seq, draft in zip(seqs, drafts):
            seq.draft = draft[:cap]
            seq.speculation.proposed = len(seq.draft)
            seq.speculation.tokens_then = seq.num_tokens

    def _best_cap(self, num_decoding: int, rates: list[float], lengths: list[int]) -> int:
        """The depth cap whose step yields the most tokens per measured second."""
        longest = max(lengths, default=0)
        if longest == 0:
            return 0
        caps = np.arange(longest + 1)
        depths = np.minimum(np.array(lengths)[None, :], caps[:, None])  # [cap, sequence]
        rows = num_decoding + depths.sum(axis=1)
        seconds = self.times.estimate(rows)
        if seconds is None:
            return longest
        tokens = num_decoding + depths @ np.array(rates)
        return int(caps[np.argmax(tokens / np.maximum(seconds, 1e-9))])

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` rows (sequences plus draft tokens) took `seconds`."""
        self.times.observe(rows, seconds)
