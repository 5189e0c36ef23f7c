"""The scheduler and engine core over a fake model that reads its answer from the KV cache:
budgets, mixed steps, preemption, prefix sharing and aborts must not change any output."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import FAKE_EOS, fake_core, fake_next_token, run_requests

from braid.engine.core import EngineError
from braid.engine.request import Request, SamplingParams
from braid.errors import UserError
from braid.step import StepResult

GREEDY = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(1, 999, n).tolist() for n in (5, 40, 130, 300, 17)]


def unconstrained(prompts, params=GREEDY):
    core, _ = fake_core(max_total_tokens=65536, max_num_batched_tokens=65536,
                        prefix_caching=False)
    return run_requests(core, prompts, params)


def test_fake_model_answers_from_the_whole_context():
    # Guards the tests below: the fake's output depends on every cached token.
    (out,) = unconstrained([PROMPTS[0]], SamplingParams(max_new_tokens=1, temperature=0))
    assert out == [fake_next_token(np.array(PROMPTS[0]))]


def test_token_budget_is_respected_and_changes_no_output():
    core, runner = fake_core(max_num_batched_tokens=32)
    assert run_requests(core, PROMPTS, GREEDY) == unconstrained(PROMPTS)
    assert max(p.num_tokens for p in runner.plans) <= 32
    assert any(len(p.q_lens) > 1 and p.q_lens.max() > 1 for p in runner.plans)  # mixed steps


def test_decodes_never_wait_for_a_whole_long_prompt():
    long_prompt = RNG.integers(1, 999, 400).tolist()
    core, runner = fake_core(max_num_batched_tokens=64)

    def arrive(core, step):
        if step == 3:  # the short requests are decoding by now
            core.add(Request("long", long_prompt, GREEDY))

    outputs = run_requests(core, PROMPTS[:2] + [PROMPTS[4]], GREEDY, on_step=arrive)
    assert outputs == unconstrained(PROMPTS[:2] + [PROMPTS[4]])
    # Every step while the long prompt is being prefilled also decodes all three others.
    prefill_steps = [p for p in runner.plans[3:] if p.q_lens.max() > 1]
    assert len(prefill_steps) >= 400 // 64
    for plan in prefill_steps:
        assert (plan.q_lens == 1).sum() == 3 and plan.num_tokens <= 64


def test_preemption_of_decodes_and_partial_prefills_changes_no_output():
    # 8 blocks of 16 and 4 tokens a step: a decoding request growing to 120 tokens and a
    # 100-token prompt prefilled 3 tokens a step beside it run out of blocks while the prompt
    # is part-way through, so the prompt is preempted (and later recomputed) mid-prefill.
    prompts = [PROMPTS[0] * 2, PROMPTS[3][:100]]
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in (110, 5)]
    core, _ = fake_core(max_total_tokens=128, max_num_batched_tokens=4)
    preempted = []
    preempt = core.scheduler._preempt

    def spy(seq):
        preempted.append((seq.num_computed, len(seq.prompt_ids)))
        preempt(seq)

    core.scheduler._preempt = spy
    outputs = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add(Request(str(i), prompt, p))
    while core.has_work:
        for delta in core.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert core.blocks.num_used == 0
    assert any(computed < prompt_len for computed, prompt_len in preempted), preempted
    expected = [unconstrained([prompt], p)[0] for prompt, p in zip(prompts, params)]
    assert [outputs["0"], outputs["1"]] == expected


def test_prefix_hits_and_aborts_change_no_output():
    shared = RNG.integers(1, 999, 70).tolist()
    prompts = [shared + RNG.integers(1, 999, n).tolist() for n in (3, 20, 9)]
    core, runner = fake_core(max_num_batched_tokens=64)
    first = run_requests(core, prompts[:1], GREEDY)
    hits = core.scheduler.prefix_hits

    def abort_one(core, step):
        if step == 2:
            core.add(Request("doomed", PROMPTS[2], GREEDY))
        if step == 4:
            used = core.blocks.num_used
            core.abort("doomed")
            assert core.blocks.num_used < used  # freed at once

    rest = run_requests(core, prompts, GREEDY, on_step=abort_one)
    assert [first[0], *rest[1:]] == unconstrained(prompts)
    assert rest[0] == first[0]
    # The 64 shared tokens (four full blocks) were found for each later request.
    assert core.scheduler.prefix_hits - hits >= 3 * 64


def test_a_request_that_can_never_fit_is_refused():
    core, _ = fake_core(max_total_tokens=64)
    with pytest.raises(UserError, match="exceeds the KV cache"):
        core.add(Request("x", [5] * 40, SamplingParams(max_new_tokens=40)))
    with pytest.raises(UserError, match="context of 4096 tokens"):
        core.add(Request("y", [5] * 4096, SamplingParams()))
    with pytest.raises(UserError, match="outside the vocabulary"):
        core.add(Request("z", [5, 1000], SamplingParams()))
    assert core.step() == [] and not core.has_work  # an empty schedule is a no-op


def test_n_completions_share_the_prompt_blocks():
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, n=3)
    core, runner = fake_core()
    core.add(Request("r", PROMPTS[2], params))
    outputs = {}
    while core.has_work:
        for delta in core.step():
            outputs.setdefault(delta.index, []).extend(delta.new_token_ids)
    assert len(outputs) == 3 and all(len(o) == 6 for o in outputs.values())
    assert outputs[0] == outputs[1] == outputs[2]  # same seed, same distribution
    # Siblings reused the first one's cached prompt: 8 full blocks each.
    assert core.scheduler.prefix_hits == 2 * (len(PROMPTS[2]) - 1) // 16 * 16
    assert core.blocks.num_used == 0


def test_stop_tokens_min_tokens_and_length():
    core, _ = fake_core()
    greedy_first = unconstrained([PROMPTS[0]], SamplingParams(max_new_tokens=1,
                                                              temperature=0))[0][0]
    stop = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(greedy_first,))
    core.add(Request("stop", PROMPTS[0], stop))
    (delta,) = core.step()
    assert (delta.finish_reason, delta.stop_reason) == ("stop", greedy_first)
    # min_tokens bans the stop token: the second choice comes instead.
    late = SamplingParams(max_new_tokens=3, temperature=0, stop_token_ids=(greedy_first,),
                          min_tokens=1)
    core.add(Request("late", PROMPTS[0], late))
    deltas = [d for _ in range(3) for d in core.step()]
    assert deltas[0].new_token_ids != [greedy_first]
    assert deltas[-1].finish_reason in ("stop", "length")
    assert not core.has_work and core.blocks.num_used == 0


def test_logprobs_and_prompt_logprobs_across_chunks():
    params = SamplingParams(max_new_tokens=2, temperature=0, logprobs=3, prompt_logprobs=2)
    core, _ = fake_core(max_num_batched_tokens=16)
    core.add(Request("r", PROMPTS[2], params))
    deltas = []
    while core.has_work:
        deltas += core.step()
    first = deltas[0]
    assert len(first.prompt_logprobs) == len(PROMPTS[2]) - 1
    assert [e.token_id for e in first.prompt_logprobs] == PROMPTS[2][1:]
    assert all(len(e.top) == 2 for e in first.prompt_logprobs)
    for delta in deltas:
        (entry,) = delta.logprobs
        assert entry.token_id == delta.new_token_ids[0] and len(entry.top) == 3
        assert entry.top[0][0] == entry.token_id  # greedy: the chosen token is the top one


def test_nan_logits_fail_only_that_request():
    core, _ = fake_core(nan_tokens=(777,))
    params = SamplingParams(max_new_tokens=4, temperature=0)
    core.add(Request("bad", [5, 6, 777], params))
    core.add(Request("good", PROMPTS[0], params))
    deltas = [d for _ in range(4) for d in core.step()]
    (bad,) = [d for d in deltas if d.request_id == "bad"]
    assert bad.finish_reason == "error" and "NaN" in bad.error
    assert sum(len(d.new_token_ids) for d in deltas if d.request_id == "good") == 4
    assert not core.has_work and core.blocks.num_used == 0


def test_a_reply_for_another_step_is_an_error():
    core, runner = fake_core()
    runner.step = lambda plan, fill_masks=None: StepResult(plan.step_id - 1)  # a stale reply
    core.add(Request("r", PROMPTS[0], GREEDY))
    with pytest.raises(EngineError, match="answered step 0 when asked for step 1"):
        core.step()


def test_eos_ends_a_sequence_unless_ignored():
    core, _ = fake_core()
    eos_first = SamplingParams(max_new_tokens=5, temperature=0)
    first = unconstrained([PROMPTS[1]], SamplingParams(max_new_tokens=1, temperature=0))[0][0]
    core.add(Request("r", PROMPTS[1], eos_first, frozenset({first})))
    (delta,) = core.step()
    assert delta.finish_reason == "stop" and delta.stop_reason is None
    assert FAKE_EOS not in delta.new_token_ids


def test_prompts_sharing_a_prefix_that_arrive_together_compute_it_once():
    shared = RNG.integers(1, 999, 100).tolist()
    prompts = [shared + [7 + i] * 5 for i in range(4)]
    core, runner = fake_core()
    outputs = run_requests(core, prompts, GREEDY)
    assert outputs == unconstrained(prompts)
    # The first computes the six shared blocks; the others wait one step and reuse them.
    assert core.scheduler.prefix_hits == 3 * 96
    assert sum(p.num_tokens for p in runner.plans[:2]) == 105 + 1 + 3 * 9  # + 1: a decode
