"""Two-batch overlap: the split policy and the stage executor (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from braid.config import StepSwitches
from braid.engine.step_choice import switch_options
from braid.overlap.operations import (
    YIELD,
    StateError,
    execute,
    execute_overlapped,
    split_stages,
)
from braid.step import StepPlan
from braid.worker.split import split_step

# the default of --tbo-token-distribution-threshold
THRESHOLD = StepSwitches().tbo_token_distribution_threshold

BLOCK = 16


def make_plan(q_lens, cached=None) -> StepPlan:
    """A plan whose sequence i has `cached[i]` tokens cached and `q_lens[i]` new ones."""
    cached = cached or [0] * len(q_lens)
    kv = [c + q for c, q in zip(cached, q_lens)]
    positions = np.concatenate([np.arange(c, k) for c, k in zip(cached, kv)])
    tables = np.array([[100 * (i + 1) + b for b in range(-(-max(kv) // BLOCK))]
                       for i in range(len(q_lens))])
    seq = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = tables[seq, positions // BLOCK] * BLOCK + positions % BLOCK
    return StepPlan(np.arange(len(positions)) + 1000, positions, slots,
                    np.array(q_lens), np.array(kv), tables)


def tokens_of(plan: StepPlan) -> list[int]:
    return plan.input_ids.tolist()


def test_prefill_cut_at_the_balancing_sequence_boundary():
    plan = make_plan([100, 90, 110, 95])
    parts = split_step(plan, THRESHOLD)
    assert parts.a.q_lens.tolist() == [100, 90] and parts.b.q_lens.tolist() == [110, 95]
    assert not parts.a_ends_mid_sequence
    assert tokens_of(parts.a) + tokens_of(parts.b) == tokens_of(plan)
    assert parts.b.block_tables.tolist() == plan.block_tables[2:].tolist()
    assert parts.b.positions.tolist() == plan.positions[190:].tolist()


def test_unbalanced_prefill_cuts_one_sequence_in_two():
    # Best boundary leaves 10 of 310 tokens on one side: cut the long prompt instead.
    plan = make_plan([300, 10])
    parts = split_step(plan, THRESHOLD)
    assert parts.a_ends_mid_sequence
    assert parts.a.q_lens.tolist() == [155] and parts.a.kv_lens.tolist() == [155]
    assert parts.b.q_lens.tolist() == [145, 10] and parts.b.kv_lens.tolist() == [300, 10]
    # The second half starts where the first ended and reads the same blocks.
    assert parts.b.positions[0] == 155
    assert parts.b.block_tables[0].tolist() == parts.a.block_tables[0].tolist()
    assert tokens_of(parts.a) + tokens_of(parts.b) == tokens_of(plan)
    assert parts.a.slot_mapping.tolist() + parts.b.slot_mapping.tolist() == \
        plan.slot_mapping.tolist()


def test_two_chunk_split_of_a_single_prompt_with_a_cached_prefix():
    plan = make_plan([64], cached=[32])
    parts = split_step(plan, THRESHOLD)
    assert parts.a.q_lens.tolist() == [32] and parts.a.kv_lens.tolist() == [64]
    assert parts.b.q_lens.tolist() == [32] and parts.b.kv_lens.tolist() == [96]
    assert parts.a.positions.tolist() == list(range(32, 64))
    assert parts.b.positions.tolist() == list(range(64, 96))


def test_threshold_flag_changes_the_choice():
    plan = make_plan([60, 40])  # best boundary: 40% on the small side
    assert split_step(plan, threshold=0.48).a_ends_mid_sequence
    assert not split_step(plan, threshold=0.4).a_ends_mid_sequence


def test_decode_splits_sequences_in_half():
    plan = make_plan([1] * 7, cached=[5, 9, 30, 2, 17, 8, 40])
    parts = split_step(plan, THRESHOLD)
    assert parts.a.q_lens.tolist() == [1, 1, 1] and parts.b.q_lens.tolist() == [1] * 4
    assert parts.a.kv_lens.tolist() == [6, 10, 31]
    assert not parts.a_ends_mid_sequence


def test_tiny_batches_run_unsplit():
    assert split_step(make_plan([1]), THRESHOLD) is None  # one token
    assert split_step(make_plan([1], cached=[50]), THRESHOLD) is None  # one decoding seq
    parts = split_step(make_plan([2]), THRESHOLD)  # the smallest prompt that can be cut
    assert parts.a.q_lens.tolist() == [1] and parts.b.q_lens.tolist() == [1]
    # the middle token starts a sequence: a plain cut
    parts = split_step(make_plan([1, 2]), THRESHOLD)
    assert parts.a.q_lens.tolist() == [1] and parts.b.q_lens.tolist() == [2]
    assert not parts.a_ends_mid_sequence


def test_no_split_is_ever_empty():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 6))
        q = rng.integers(1, 40, n).tolist()
        plan = make_plan(q, cached=rng.integers(0, 30, n).tolist())
        parts = split_step(plan, threshold=float(rng.uniform(0.05, 0.5)))
        if parts is None:
            assert sum(q) < 2
            continue
        for part in (parts.a, parts.b):
            assert part.num_tokens > 0 and (part.q_lens > 0).all()
            assert part.q_lens.sum() == part.num_tokens
        assert tokens_of(parts.a) + tokens_of(parts.b) == tokens_of(plan)


def test_switch_options_fixed_threshold_or_learned():
    assert switch_options("on", 1, None, True) == (True,)
    assert switch_options("off", 10**6, 1, True) == (False,)
    assert switch_options("auto", 1024, 1024, True) == (True,)  # a threshold: a fixed rule
    assert switch_options("auto", 1023, 1024, True) == (False,)
    assert switch_options("auto", 10**6, None, False) == (False,)  # one rank: nothing to hide
    assert switch_options("auto", 8, None, True) == (False, True)  # learned per step size


# --- executor ---------------------------------------------------------------------------------

def recording_ops(log):
    """Three stages; each op appends (micro-batch, stage) and passes a value along."""

    def first(state, batch):
        log.append((batch, 0))
        state.put("x", 1)

    def second(state, batch):
        log.append((batch, 1))
        state.put("x", state.take("x") + 1)

    def last(state, batch):
        log.append((batch, 2))
        state.put("logits", state.take("x") + 1)

    return [first, YIELD, second, YIELD, last]


def test_stages_split_at_yields():
    ops = recording_ops([])
    assert [len(s) for s in split_stages(ops)] == [1, 1, 1]
    assert [len(s) for s in split_stages([YIELD, *ops, YIELD])] == [1, 1, 1]


def test_execute_ignores_yields():
    log = []
    assert execute(recording_ops(log), "A") == {"logits": 3}
    assert log == [("A", 0), ("A", 1), ("A", 2)]


@pytest.mark.parametrize("delta,expected", [
    (0, ["A0", "B0", "A1", "B1", "A2", "B2"]),
    (1, ["A0", "A1", "B0", "A2", "B1", "B2"]),
])
def test_overlapped_stage_order(delta, expected):
    log = []
    out_a, out_b = execute_overlapped(recording_ops(log), "A", "B", delta_stages=delta)
    assert out_a == out_b == {"logits": 3}
    assert [f"{b}{k}" for b, k in log] == expected


def test_a_leaked_value_is_detected():
    def leaky(state, batch):
        state.put("logits", 0)
        state.put("forgotten_handle", object())

    with pytest.raises(StateError, match="forgotten_handle"):
        execute([leaky], None)


def test_a_missing_wait_is_detected():
    # The second op launches again without waiting for the first launch: an overwrite.
    def launch(state, batch):
        state.put("partial", object())

    with pytest.raises(StateError, match="'partial' is already set"):
        execute_overlapped([launch, YIELD, launch], "A", "B")


def test_a_value_never_produced_is_detected():
    with pytest.raises(StateError, match="never produced"):
        execute([lambda state, batch: state.take("partial")], None)
