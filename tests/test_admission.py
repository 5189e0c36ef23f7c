"""What one request can do to the others in the engine core: a failure while planning,
sampling or recording its step fails it alone; admission takes turns between groups, lets
small prompts overtake one that does not fit for a bounded time, and aborts in O(1); the
siblings of `n` share the scoring of their prompt. Over the fake model of `engine_utils`."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import fake_core

import braid.engine.plan as plan_module
import braid.engine.scheduler as scheduler_module
from braid.engine.request import Request, SamplingParams
from braid.errors import UserError

GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
RNG = np.random.default_rng(1)


def prompt(n: int) -> list[int]:
    return RNG.integers(1, 999, n).tolist()


def drain(core, max_steps: int = 10_000) -> list:
    deltas = []
    for _ in range(max_steps):
        if not core.has_work:
            break
        deltas += core.step()
    assert not core.has_work and core.blocks.num_used == 0, "work or KV blocks left over"
    return deltas


def tokens_of(deltas, request_id: str) -> int:
    return sum(len(d.new_token_ids) for d in deltas if d.request_id == request_id)


def test_a_request_whose_plan_fails_fails_alone(monkeypatch):
    # Any exception a request's own parameters raise while the step is planned (here,
    # injected into its penalty's history) ends that request; before, it ended the engine.
    real = plan_module._penalty

    def penalty(seq, *args):
        if seq.request_id == "bad":
            raise OverflowError("Python int too large to convert to C long")
        return real(seq, *args)

    monkeypatch.setattr(plan_module, "_penalty", penalty)
    core, _ = fake_core()
    core.add(Request("good", prompt(20), GREEDY))
    core.add(Request("bad", prompt(20), SamplingParams(max_new_tokens=6, temperature=0,
                                                        repetition_penalty=1.2)))
    deltas = drain(core)
    (bad,) = [d for d in deltas if d.request_id == "bad"]
    assert bad.finish_reason == "error" and "OverflowError" in bad.error
    assert tokens_of(deltas, "good") == 6


def test_a_request_whose_token_cannot_be_recorded_fails_alone(monkeypatch):
    real = scheduler_module.Scheduler._record_tokens

    def record(self, seq, result, rows):
        if seq.request_id == "bad" and len(seq.output_ids) == 2:
            raise RuntimeError("injected")
        return real(self, seq, result, rows)

    monkeypatch.setattr(scheduler_module.Scheduler, "_record_tokens", record)
    core, _ = fake_core()
    for request_id in ("a", "bad", "b"):
        core.add(Request(request_id, prompt(30), GREEDY))
    deltas = drain(core)
    assert tokens_of(deltas, "bad") == 2
    assert [d.finish_reason for d in deltas if d.request_id == "bad"][-1] == "error"
    assert tokens_of(deltas, "a") == tokens_of(deltas, "b") == 6


def test_sampling_failures_of_one_request_fail_it_alone():
    # A stop token id past the vocabulary, banned before min_tokens, used to index past the
    # logits on rank 0 and kill the rank; the API now refuses it, and the sampler would
    # fail only its row.
    core, _ = fake_core()
    bad = SamplingParams(max_new_tokens=4, min_tokens=2, temperature=0,
                         stop_token_ids=(100_000_000,))
    with pytest.raises(UserError, match="stop_token_ids"):  # the engine's own check first

        core.add(Request("bad", prompt(5), bad))
    core.check_request = lambda ids, params: None  # past the check: the sampler's turn
    core.add(Request("bad", prompt(5), bad))
    core.add(Request("good", prompt(5), GREEDY))
    deltas = drain(core)
    (failed,) = [d for d in deltas if d.request_id == "bad"]
    assert failed.finish_reason == "error" and "sampling parameters" in failed.error
    assert tokens_of(deltas, "good") == 6


def test_groups_take_turns_at_admission():
    # 40 requests of one client arrive first, then one of another; 4 may run at once.
    # First in, first out would admit the lone one after the first 36 had finished.
    core, _ = fake_core(max_running_requests=4)
    for i in range(40):
        core.add(Request(f"big-{i}", prompt(12), GREEDY, group="big"))
    core.add(Request("small", prompt(12), GREEDY, group="small"))
    finished = []
    while core.has_work:
        finished += [d.request_id for d in core.step() if d.finish_reason]
    assert finished.index("small") <= 4, finished[:8]


def test_a_prompt_that_does_not_fit_is_overtaken_then_waited_for():
    # 12 blocks of 16 tokens: a running request holds 4; a 150-token prompt (10 blocks)
    # cannot be admitted; small prompts behind it may overtake it until it has waited
    # `max_skip_age_s`, then admission waits for it.
    now = [0.0]
    core, _ = fake_core(max_total_tokens=16 * 12, max_skip_age_s=5.0)
    core.scheduler.clock = lambda: now[0]
    long_run = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    core.add(Request("running", prompt(60), long_run))
    core.step()
    core.add(Request("large", prompt(150), GREEDY))
    core.add(Request("small-1", prompt(10), GREEDY))
    core.step()
    admitted = [s.request_id for s in core.scheduler.running]
    assert "small-1" in admitted and "large" not in admitted  # overtaken
    now[0] = 6.0  # the large prompt has waited long enough
    core.add(Request("small-2", prompt(10), GREEDY))
    core.step()
    assert "small-2" not in [s.request_id for s in core.scheduler.running]
    deltas = drain(core)
    order = [d.request_id for d in deltas if d.finish_reason]
    assert order.index("large") < order.index("small-2")


def test_aborting_a_request_of_many_sequences_frees_everything():
    core, _ = fake_core(max_running_requests=8)
    many = SamplingParams(max_new_tokens=50, temperature=1.0, n=64, ignore_eos=True)
    for i in range(20):
        core.add(Request(f"r{i}", prompt(8), many, group="flood"))
    core.step()
    assert len(core.scheduler.waiting) == 20 * 64 - 8
    for i in range(20):
        core.abort(f"r{i}")
    assert not core.has_work and core.blocks.num_used == 0 and len(core.scheduler.waiting) == 0


def test_siblings_share_the_scoring_of_their_prompt():
    # echo + logprobs + n: completion 0 scores the prompt; its siblings share its blocks
    # instead of each prefilling (and scoring) the whole prompt again.
    core, runner = fake_core()
    params = SamplingParams(max_new_tokens=2, temperature=0, n=4, prompt_logprobs=1,
                            ignore_eos=True)
    ids = prompt(100)
    core.add(Request("r", ids, params))
    deltas = drain(core)
    prompt_tokens = sum(int(p.q_lens[p.q_lens > 1].sum()) for p in runner.plans)
    assert prompt_tokens < 2 * len(ids)  # was 4 x 100
    scored = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(scored) == 1 and [e.token_id for e in scored[0]] == ids[1:]
