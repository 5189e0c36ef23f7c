"""Speculative decoding on the driver: which tokens each decoding sequence proposes for the
next step, and whether proposing pays at all.

A sequence's draft is verified by the next step as extra decode rows (`plan.build_plan`) and
accepted by the scheduler (`Scheduler._record_tokens`); this module only proposes.

- **Proposers.** `ngram` (prompt lookup, as vLLM's `ngram` and llama.cpp's lookup decoding):
  the latest earlier occurrence of the sequence's last n tokens (n from `ngram_max` down to
  `ngram_min`) in its own prompt and output, and the tokens that followed it there.
- **Policy.** Each sequence keeps a recent acceptance rate `a` (accepted over verified
  proposals, decayed, starting from a prior). A proposed token at depth i is accepted with
  probability about a^i; it costs one more row in the step. The step's time is measured as a
  function of its rows (`StepCost`, fitted while serving), so a token at depth i is proposed
  only while a^i exceeds what a row costs relative to what the step yields per row:
  `slope * rows / time`. At small batch a row is almost free (the weights are read once
  either way), at large batch on a compute-bound host it costs what a sequence's token does,
  and speculation switches itself off. Until two batch sizes have been timed it proposes.
  A sequence whose rate fell too low to propose drifts back toward the prior while it does
  not propose, so text that turns repetitive later is tried again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from braid.engine.request import Sequence

# A new sequence's acceptance rate, 0.5, as the counts of two verified proposals
PRIOR_ACCEPTED, PRIOR_VERIFIED = 1.0, 2.0
DECAY = 0.8  # per verified step: the rate follows the last few steps' text
IDLE_DECAY = 0.97  # per step without a proposal: back toward the prior in tens of steps
MIN_ACCEPTANCE = 0.05  # below this a sequence proposes nothing (also when rows are free)
COST_WINDOW = 256  # decode steps whose times fit `StepCost`


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
    verified: float = PRIOR_VERIFIED
    proposed: int = 0
    tokens_then: int = 0
    index: NgramIndex | None = None

    @property
    def rate(self) -> float:
        return self.accepted / self.verified

    def learn(self, num_tokens: int) -> None:
        """Count how much of the last draft was accepted, now that the sequence has
        `num_tokens` tokens (a draft not verified, its sequence preempted, counts nothing)."""
        if self.proposed and num_tokens > self.tokens_then:
            accepted = min(num_tokens - self.tokens_then - 1, self.proposed)
            # Proposals are tried in order until one is rejected: a geometric count.
            self.accepted = DECAY * self.accepted + accepted
            self.verified = DECAY * self.verified + accepted + (accepted < self.proposed)
        elif not self.proposed:
            self.accepted = IDLE_DECAY * self.accepted + (1 - IDLE_DECAY) * PRIOR_ACCEPTED
            self.verified = IDLE_DECAY * self.verified + (1 - IDLE_DECAY) * PRIOR_VERIFIED
        self.proposed = 0


class StepCost:
    """Decode step time as `base + slope * rows`, least squares over the latest
    `COST_WINDOW` decode steps (the median time of each row count, so a noisy step weighs
    little)."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)
        self._fit: tuple[float, float] | None = None
        self._since_fit = 0

    def observe(self, rows: int, seconds: float) -> None:
        self._steps.append((rows, seconds))
        self._since_fit += 1

    def fit(self) -> tuple[float, float] | None:
        """(base, slope) in seconds, or None until two row counts have been timed."""
        if self._since_fit >= 16 or self._fit is None:
            self._since_fit = 0
            by_rows: dict[int, list[float]] = {}
            for rows, seconds in self._steps:
                by_rows.setdefault(rows, []).append(seconds)
            if len(by_rows) >= 2:
                xs = np.array(list(by_rows), dtype=np.float64)
                ys = np.array([np.median(v) for v in by_rows.values()])
                slope, base = np.polyfit(xs, ys, 1)
                self._fit = (float(base), max(float(slope), 0.0))
        return self._fit

    def row_price(self, rows: int) -> float:
        """What one more row costs, as a share of what a step of `rows` rows yields per row
        (0 while unmeasured: speculation is tried)."""
        fit = self.fit()
        if fit is None:
            return 0.0
        base, slope = fit
        time = base + slope * rows
        return slope * rows / time if time > 0 else 0.0


class Speculator:
    """Sets each decoding sequence's draft before the scheduler plans a step."""

    def __init__(self, proposer: Proposer, max_tokens: int) -> None:
        self.proposer = proposer
        self.max_tokens = max_tokens
        self.cost = StepCost()

    def propose(self, decoding: list[Sequence]) -> None:
        """Drafts for the sequences about to decode (an empty one where speculation does not
        pay, or cannot apply: a grammar constrains the sequence, or it is about to end)."""
        price = self.cost.row_price(len(decoding))
        seqs, ks = [], []
        for seq in decoding:
            if seq.speculation is None:
                seq.speculation = SequenceSpeculation()
            state = seq.speculation
            state.learn(seq.num_tokens)
            seq.draft = []
            room = min(seq.params.max_new_tokens - len(seq.output_ids) - 1, self.max_tokens)
            if seq.grammar is not None or room <= 0:
                continue
            seqs.append(seq)
            ks.append(self._depth(state.rate, price, room))
        for seq, k, draft in zip(seqs, ks, self.proposer.propose(seqs, ks)):
            seq.draft = draft[:k]
            seq.speculation.proposed = len(seq.draft)
            seq.speculation.tokens_then = seq.num_tokens

    @staticmethod
    def _depth(rate: float, price: float, most: int) -> int:
        """Proposals worth their rows: depth i while rate^i exceeds the row's price."""
        if rate < MIN_ACCEPTANCE:
            return 0
        depth, reach = 0, rate
        while depth < most and reach > price:
            depth += 1
            reach *= rate
        return depth

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` rows (sequences plus draft tokens) took `seconds`."""
        self.cost.observe(rows, seconds)
