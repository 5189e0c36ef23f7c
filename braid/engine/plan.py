"""From the scheduler's chosen sequences to the `StepPlan` every rank runs.

Logits are computed only where something needs them: the last token of a sequence whose step
yields its next token (one sampling row each), and, for requests that asked for prompt
logprobs, every prompt position whose next prompt token is scored. A chunk in the middle of a
prompt needs none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from braid.engine.batch import Penalty, PromptLogprobRows, SamplingBatch, StepPlan
from braid.engine.request import Sequence


@dataclass(frozen=True)
class SequenceRows:
    """Where a sequence's results are in the step's answer: its sampling row (None: the step
    ends inside its prompt) and its run of prompt-logprob rows."""

    sample_row: int | None
    prompt_start: int
    prompt_count: int


def build_plan(batch: list[Sequence], block_size: int,
               step_id: int) -> tuple[StepPlan, list[SequenceRows]]:
    """The plan of one step in which each sequence computes its `scheduled_tokens` tokens."""
    q_lens = np.array([s.scheduled_tokens for s in batch], dtype=np.int64)
    kv_lens = np.array([s.num_computed + s.scheduled_tokens for s in batch], dtype=np.int64)
    positions = np.concatenate([np.arange(s.num_computed, end)
                                for s, end in zip(batch, kv_lens)]).astype(np.int64)
    input_ids = np.array([t for s, end in zip(batch, kv_lens)
                          for t in s.token_slice(s.num_computed, int(end))], dtype=np.int64)
    tables = np.zeros((len(batch), max(len(s.blocks) for s in batch)), dtype=np.int64)
    for row, s in enumerate(batch):
        tables[row, :len(s.blocks)] = s.blocks
    seq_index = np.repeat(np.arange(len(batch)), q_lens)
    slots = tables[seq_index, positions // block_size] * block_size + positions % block_size

    logit_rows: list[int] = []
    sampled: list[Sequence] = []
    sample_rows: list[int] = []
    scored: list[tuple[int, int, int]] = []  # (logit row, target token, alternatives)
    layout = []
    offset = 0
    for seq in batch:
        start, end = seq.num_computed, seq.num_computed + seq.scheduled_tokens
        prompt_start = len(scored)
        if seq.scores_prompt:
            # Position p scores prompt token p + 1; positions already scored are skipped
            # (a prompt recomputed after preemption).
            for pos in range(max(start, len(seq.prompt_logprobs)),
                             min(end, len(seq.prompt_ids) - 1)):
                scored.append((len(logit_rows), seq.prompt_ids[pos + 1],
                               seq.params.prompt_logprobs))
                logit_rows.append(offset + pos - start)
        sample_row = None
        if end == seq.num_tokens:  # the step yields the sequence's next token
            sample_row = len(sampled)
            sampled.append(seq)
            sample_rows.append(len(logit_rows))
            logit_rows.append(offset + end - 1 - start)
        layout.append(SequenceRows(sample_row, prompt_start, len(scored) - prompt_start))
        offset += seq.scheduled_tokens

    prompt_logprobs = None
    if scored:
        rows, targets, counts = (np.array(column, dtype=np.int64) for column in zip(*scored))
        prompt_logprobs = PromptLogprobRows(rows, targets, counts)
    plan = StepPlan(input_ids, positions, slots.astype(np.int64), q_lens, kv_lens, tables,
                    logit_rows=np.array(logit_rows, dtype=np.int64),
                    sample_rows=np.array(sample_rows, dtype=np.int64),
                    sampling=sampling_batch(sampled) if sampled else None,
                    prompt_logprobs=prompt_logprobs, step_id=step_id)
    return plan, layout


def sampling_batch(seqs: list[Sequence]) -> SamplingBatch:
    """Sampling rows for sequences about to get their next token."""
    params = [s.params for s in seqs]
    return SamplingBatch(
        temperatures=np.array([p.temperature for p in params], dtype=np.float32),
        top_ks=np.array([p.top_k for p in params], dtype=np.int64),  # < 2**31: SamplingParams
        top_ps=np.array([p.top_p for p in params], dtype=np.float32),
        min_ps=np.array([p.min_p for p in params], dtype=np.float32),
        seeds=[p.seed for p in params],
        output_positions=np.array([len(s.output_ids) for s in seqs], dtype=np.int64),
        num_logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params],
                              dtype=np.int64),
        scored_ids=[p.logprob_token_ids for p in params],
        penalties=[_penalty(s) for s in seqs],
        banned=[_banned(s) for s in seqs],
        biases=[p.logit_bias for p in params],
    )


def _penalty(seq: Sequence) -> Penalty | None:
    p = seq.params
    if not p.penalized:
        return None
    return Penalty(p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                   np.unique(np.array(seq.prompt_ids, dtype=np.int64)),
                   np.array(seq.output_ids, dtype=np.int64))


def _banned(seq: Sequence) -> tuple[int, ...]:
    """Tokens that would end the sequence before `min_tokens`."""
    p = seq.params
    if len(seq.output_ids) >= p.min_tokens:
        return ()
    stops = set(p.stop_token_ids)
    if not p.ignore_eos:
        stops |= seq.eos_token_ids
    return tuple(sorted(stops))
