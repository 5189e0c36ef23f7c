"""From the scheduler's chosen sequences to the `StepPlan` every rank runs.

Logits are computed only where something needs them: the last token of a sequence whose step
yields its next token (one sampling row each), and, for requests that asked for prompt
logprobs, every prompt position whose next prompt token is scored. A chunk in the middle of a
prompt needs none.

A decoding sequence with proposed tokens (`Sequence.draft`, speculative decoding) is verified
as k + 1 decode rows: row j holds token j of `[last token, draft...]`, attends to the sequence's
keys up to and including its own position (the rows write their keys before any row attends,
so row j sees rows 0..j-1 of the same step) and samples the token that follows it. Every
attention path, the compiled decode graph included, thus scores k + 1 positions unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from braid.engine.request import Sequence
from braid.step import Penalty, PromptLogprobRows, SamplingBatch, StepPlan


@dataclass(frozen=True)
class SequenceRows:
    """Where a sequence's results are in the step's answer: its first sampling row (None: the
    step ends inside its prompt), how many consecutive sampling rows it has (1 + its draft's
    length), and its run of prompt-logprob rows."""

    sample_row: int | None
    prompt_start: int
    prompt_count: int
    num_sample_rows: int = 1
    pool_row: int | None = None  # an embedding's pool segment in this step
    pool_final: bool = False  # ... the last one: the embedding is complete


def _attention_rows(seq: Sequence) -> list[tuple[int, int]]:
    """(first token, end) of each attention row the sequence contributes: one row for its
    scheduled tokens, or one decode row per token when it verifies a draft."""
    start = seq.num_computed
    if seq.draft:
        return [(p, p + 1) for p in range(start, start + seq.scheduled_tokens)]
    return [(start, start + seq.scheduled_tokens)]


def slot_mapping(tables: np.ndarray, q_lens: np.ndarray, positions: np.ndarray,
                 block_size: int) -> np.ndarray:
    """The KV cache slot of each token: row b of `tables` holds the blocks of the `q_lens[b]`
    tokens at `positions` (concatenated by row)."""
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    return tables[rows, positions // block_size] * block_size + positions % block_size


def attention_layout(attention: list[tuple[Sequence, int, int]], block_size: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q_lens, kv_lens, positions, block tables and slots of attention rows, each a sequence's
    tokens [start, end) (as `StepPlan` holds them)."""
    q_lens = np.array([end - start for _, start, end in attention], dtype=np.int64)
    kv_lens = np.array([end for _, _, end in attention], dtype=np.int64)
    positions = np.concatenate([np.arange(start, end) for _, start, end in attention]
                               ).astype(np.int64)
    tables = np.zeros((len(attention), max(len(s.blocks) for s, _, _ in attention)),
                      dtype=np.int64)
    for row, (seq, _, _) in enumerate(attention):
        tables[row, :len(seq.blocks)] = seq.blocks
    return q_lens, kv_lens, positions, tables, slot_mapping(tables, q_lens, positions,
                                                            block_size)


def build_plan(batch: list[Sequence], block_size: int,
               step_id: int) -> tuple[StepPlan, list[SequenceRows]]:
    """The plan of one step in which each sequence computes its `scheduled_tokens` tokens
    (its last token and its draft, for a sequence with a draft)."""
    attention = [(seq, start, end) for seq in batch for start, end in _attention_rows(seq)]
    q_lens, kv_lens, positions, tables, slots = attention_layout(attention, block_size)
    input_ids = np.array([t for seq in batch for t in seq.token_slice(
        seq.num_computed, seq.num_computed + seq.scheduled_tokens - len(seq.draft)) + seq.draft],
        dtype=np.int64)

    logit_rows: list[int] = []
    sampled: list[tuple[Sequence, int]] = []  # (sequence, how many draft tokens precede)
    sample_rows: list[int] = []
    scored: list[tuple[int, int, int]] = []  # (logit row, target token, alternatives)
    pooled: list[tuple[int, int]] = []  # token ranges whose hidden states are summed
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
        sample_row = pool_row = None
        verified = len(seq.draft) + 1
        final = end == seq.num_tokens + len(seq.draft)  # the step yields the next token
        if seq.params.pooling is not None:  # an embedding: its rows pooled, none sampled
            if seq.params.pooling == "mean" or final:
                pool_row = len(pooled)
                pooled.append((offset if seq.params.pooling == "mean" else offset + end
                               - start - 1, offset + end - start))
        elif final:
            sample_row = len(sampled)
            for j in range(verified):
                sampled.append((seq, j))
                sample_rows.append(len(logit_rows))
                logit_rows.append(offset + end - verified + j - start)
        layout.append(SequenceRows(sample_row, prompt_start, len(scored) - prompt_start,
                                   verified, pool_row, pool_row is not None and final))
        offset += seq.scheduled_tokens

    prompt_logprobs = None
    if scored:
        rows, targets, counts = (np.array(column, dtype=np.int64) for column in zip(*scored))
        prompt_logprobs = PromptLogprobRows(rows, targets, counts)
    plan = StepPlan(input_ids, positions, slots.astype(np.int64), q_lens, kv_lens, tables,
                    logit_rows=np.array(logit_rows, dtype=np.int64),
                    sample_rows=np.array(sample_rows, dtype=np.int64),
                    sample_runs=np.array([rows.num_sample_rows for rows in layout
                                          if rows.sample_row is not None], dtype=np.int64),
                    sampling=sampling_batch(sampled) if sampled else None,
                    prompt_logprobs=prompt_logprobs, step_id=step_id,
                    pool_segments=np.array(pooled, dtype=np.int64) if pooled else None)
    return plan, layout


def sampling_batch(rows: list[Sequence] | list[tuple[Sequence, int]]) -> SamplingBatch:
    """Sampling rows for sequences about to get their next token: a sequence, or (sequence,
    j) for the row that follows the first j tokens of its draft (its output positions, seeds,
    penalties' history and `min_tokens` count those j tokens as generated)."""
    rows = [row if isinstance(row, tuple) else (row, 0) for row in rows]
    params = [s.params for s, _ in rows]
    # A sequence's prompt tokens, once for all its rows (penalized sequences only)
    prompts = {id(s): np.unique(np.array(s.prompt_ids, dtype=np.int64))
               for s, _ in rows if s.params.penalized}
    return SamplingBatch(
        temperatures=np.array([p.temperature for p in params], dtype=np.float32),
        top_ks=np.array([p.top_k for p in params], dtype=np.int64),  # < 2**31: SamplingParams
        top_ps=np.array([p.top_p for p in params], dtype=np.float32),
        min_ps=np.array([p.min_p for p in params], dtype=np.float32),
        seeds=[p.seed for p in params],
        output_positions=np.array([len(s.output_ids) + j for s, j in rows], dtype=np.int64),
        num_logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params],
                              dtype=np.int64),
        scored_ids=[p.logprob_token_ids for p in params],
        penalties=[_penalty(s, j, prompts.get(id(s))) for s, j in rows],
        banned=[_banned(s, j) for s, j in rows],
        biases=[p.logit_bias for p in params],
    )


def _penalty(seq: Sequence, drafted: int, prompt_ids: np.ndarray | None) -> Penalty | None:
    """The penalties of the row after `drafted` draft tokens (`prompt_ids`: the prompt's
    unique tokens)."""
    p = seq.params
    if not p.penalized:
        return None
    return Penalty(p.repetition_penalty, p.presence_penalty, p.frequency_penalty, prompt_ids,
                   np.array(seq.output_ids + seq.draft[:drafted], dtype=np.int64))


def _banned(seq: Sequence, drafted: int) -> tuple[int, ...]:
    """Tokens that would end the sequence before `min_tokens`."""
    p = seq.params
    if len(seq.output_ids) + drafted >= p.min_tokens:
        return ()
    stops = set(p.stop_token_ids)
    if not p.ignore_eos:
        stops |= seq.eos_token_ids
    return tuple(sorted(stops))
