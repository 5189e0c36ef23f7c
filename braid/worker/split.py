"""How a step is cut into two micro-batches for two-batch overlap, and when it is worth it.

- Decode (one token per sequence): half the sequences each.
- Prefill/extend: cut at the sequence boundary that best balances tokens. If the smaller side
  would still hold less than `threshold` of the tokens (one long prompt among short ones, or a
  single prompt), cut the sequence holding the middle token in two instead ("two-chunk"): the
  second part attends to the keys and values the first part writes earlier in the same step,
  because micro-batch A runs each stage before B does.

Each part gets its own token range, positions, KV slots, block tables and lengths; a step too
small to split (one token, or one decoding sequence) is not split, so no empty micro-batch runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from braid.step import StepPlan


@dataclass
class MicroBatches:
    """The two halves of a step, each with its share of the logit rows (A's rows come first,
    so the two parts' logits concatenate in the step's order). `a_ends_mid_sequence`: A ends
    inside a sequence that B finishes (a two-chunk split)."""

    a: StepPlan
    b: StepPlan
    a_ends_mid_sequence: bool


def _part(plan: StepPlan, seqs: slice, tokens: slice, q_lens: np.ndarray,
          kv_lens: np.ndarray) -> StepPlan:
    logit_rows = plan.logit_rows
    if logit_rows is not None:  # this part's rows, as indices into its own tokens
        start, stop = tokens.start or 0, tokens.stop or plan.num_tokens
        logit_rows = logit_rows[(logit_rows >= start) & (logit_rows < stop)] - start
    return replace(plan, input_ids=plan.input_ids[tokens], positions=plan.positions[tokens],
                   slot_mapping=plan.slot_mapping[tokens], q_lens=q_lens, kv_lens=kv_lens,
                   block_tables=plan.block_tables[seqs], logit_rows=logit_rows,
                   sample_rows=None, sampling=None, prompt_logprobs=None)


def _cut_between_sequences(plan: StepPlan, cut: int) -> MicroBatches:
    tokens = int(plan.q_lens[:cut].sum())
    a = _part(plan, slice(0, cut), slice(0, tokens), plan.q_lens[:cut], plan.kv_lens[:cut])
    b = _part(plan, slice(cut, None), slice(tokens, None), plan.q_lens[cut:],
              plan.kv_lens[cut:])
    return MicroBatches(a, b, False)


def _cut_inside_sequence(plan: StepPlan, mid: int) -> MicroBatches:
    ends = np.cumsum(plan.q_lens)
    j = int(np.searchsorted(ends, mid, side="right"))  # the sequence holding token `mid`
    if j > 0 and ends[j - 1] == mid:  # `mid` starts a sequence: nothing to cut in two
        return _cut_between_sequences(plan, j)
    second = int(ends[j] - mid)  # its tokens that go to B
    q_a = plan.q_lens[:j + 1].copy()
    q_a[j] -= second
    kv_a = plan.kv_lens[:j + 1].copy()
    kv_a[j] -= second
    q_b = plan.q_lens[j:].copy()
    q_b[0] = second
    a = _part(plan, slice(0, j + 1), slice(0, mid), q_a, kv_a)
    b = _part(plan, slice(j, None), slice(mid, None), q_b, plan.kv_lens[j:])
    return MicroBatches(a, b, True)


def split_step(plan: StepPlan, threshold: float) -> MicroBatches | None:
    """Two micro-batches for `plan`, or None when it cannot be split; a sequence is cut in two
    where the best cut between sequences leaves a side less than `threshold` of the tokens
    (`--tbo-token-distribution-threshold`)."""
    q_lens = plan.q_lens
    total = int(q_lens.sum())
    if total < 2:
        return None
    if bool((q_lens == 1).all()):
        return _cut_between_sequences(plan, len(q_lens) // 2)
    if len(q_lens) > 1:
        boundaries = np.cumsum(q_lens)[:-1]
        best = int(np.argmin(np.abs(2 * boundaries - total)))
        left = int(boundaries[best])
        if min(left, total - left) >= threshold * total:
            return _cut_between_sequences(plan, best + 1)
    return _cut_inside_sequence(plan, total // 2)
