"""Speculative decoding: proposals verified as extra decode rows, accepted exactly, rolled back
exactly; greedy and seeded outputs equal plain decoding's, sampled frequencies match it."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from engine_utils import RunnerExecutor, fake_core, fake_next_token, run_requests

from braid.config import EngineConfig, KVCacheConfig, SchedulerConfig
from braid.engine.core import EngineCore
from braid.engine.kv_cache import BlockManager
from braid.engine.request import SamplingParams, Sequence
from braid.engine.scheduler import Scheduler
from braid.engine.speculation import (
    LEDGER_DRAFTS,
    MIN_TIMINGS,
    PAUSE_STEPS,
    AcceptanceRate,
    NgramIndex,
    NgramProposer,
    SequenceSpeculation,
    Speculator,
    StepTimes,
    step_times_file,
)
from braid.errors import UserError


class OracleProposer:
    """Proposes the fake model's favourite continuation with a wrong token at a random depth
    (or none), so steps accept all, part or none of their drafts."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, ks):
            context = seq.prompt_ids + seq.output_ids
            draft = []
            wrong_at = self.rng.randrange(k + 2)
            for depth in range(k):
                token = fake_next_token(np.array(context))
                if depth == wrong_at:
                    token = token % 997 + 1  # another token
                draft.append(token)
                context.append(token)
            drafts.append(draft)
        return drafts


class UntimedSteps(StepTimes):
    """Step times never known: drafts go as deep as proposed, whatever this host's timings
    (the fake model's steps take microseconds and vary), so runs are reproducible."""

    def estimate(self, rows):
        return None


def speculating_fake_core(proposer=None, max_tokens: int = 4, **engine_args):
    core, runner = fake_core(**engine_args)
    core.speculator = Speculator(proposer or OracleProposer(), max_tokens)
    core.speculator.times = UntimedSteps()
    return core, runner


PROMPTS = [[5, 6, 7, 8, 9] * 7, [11, 12, 13] * 11 + [14], [5, 6, 7, 8, 9] * 7 + [21, 22],
           list(range(100, 140))]


GREEDY = SamplingParams(max_new_tokens=40, temperature=0)
# Penalties that favour tokens already generated (drafted ones included) enough to change draws
SEEDED = SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, repetition_penalty=0.25,
                        presence_penalty=-2.0, frequency_penalty=-2.0, min_tokens=12,
                        stop_token_ids=tuple(range(1, 150)))
# Token 5 always wins once allowed: the sequence ends exactly at min_tokens, inside a draft of
# the fake model's favourites that the rows before it accept
MIN_TOKENS = SamplingParams(max_new_tokens=40, temperature=0, min_tokens=10,
                            stop_token_ids=(5,), logit_bias={5: 100.0})
PREEMPTING = 112  # cache tokens: the four prompts do not fit together


@pytest.mark.parametrize(("params", "cache_tokens"), [
    (GREEDY, 4096), (GREEDY, PREEMPTING), (SEEDED, 4096), (SEEDED, PREEMPTING),
    (MIN_TOKENS, 4096)], ids=["greedy", "greedy-preempting", "seeded-penalties-stops",
                              "seeded-preempting", "min-tokens"])
def test_outputs_equal_plain_decoding(params, cache_tokens):
    """Against the fake model, which reads its whole context back from the KV cache: a stale
    key of a rejected token, a slot off by one or a block registered in the prefix cache
    with a rejected token in it changes every later token."""
    plain = run_requests(fake_core(max_total_tokens=cache_tokens)[0], PROMPTS, params)
    core, _ = speculating_fake_core(max_total_tokens=cache_tokens)
    assert run_requests(core, PROMPTS, params) == plain
    scheduler = core.scheduler
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    assert core.num_steps < sum(map(len, plain))  # several tokens a step, at times
    if cache_tokens == PREEMPTING:
        assert scheduler.num_preemptions > 0
    assert scheduler.prefix_hits > 0  # prompts 0 and 2 share blocks


def test_rejected_tokens_give_their_blocks_back():
    core, runner = speculating_fake_core(proposer=OracleProposer(), max_tokens=16,
                                         block_size=4)
    params = SamplingParams(max_new_tokens=30, temperature=0)
    run_requests(core, [[3, 4, 5]], params, on_step=lambda core, step: _check_blocks(core))


def test_a_draft_takes_no_block_a_later_decode_needs():
    blocks = BlockManager(KVCacheConfig(max_total_tokens=16, block_size=4))  # 4 blocks
    scheduler = Scheduler(blocks, SchedulerConfig(max_num_batched_tokens=64,
                                                  max_running_requests=8), max_context=64)
    first, second = (Sequence(i, str(i), 0, [1, 2, 3, 4], SamplingParams()) for i in range(2))
    for seq in (first, second):  # each has filled its block: its next token needs another
        seq.output_ids, seq.blocks, seq.num_computed = [5], blocks.allocate(1), 4
        scheduler.running[seq] = None
    first.draft = [6] * 6  # would take both free blocks
    assert scheduler.schedule() == [first, second]
    assert scheduler.num_preemptions == 0
    assert first.draft == [6] * 3 and first.scheduled_tokens == 4  # fills its new block


def _check_blocks(core: EngineCore) -> None:
    for seq in core.scheduler.running:
        if not seq.draft:  # between steps: just what its tokens need
            assert len(seq.blocks) == -(-seq.num_tokens // core.blocks.block_size)


def test_sampled_frequencies_match_plain_decoding():
    """Unseeded sampling: the tokens differ draw by draw, their distribution must not. The
    fake model's favourite token has probability ~0.63 at every position; the pattern of
    which of the first 5 positions took it (32 outcomes) is compared by a chi-square test
    between 600 completions with and without speculation. The proposer drafts the
    favourites, so acceptances and rejections are frequent."""
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    prompts = [[7, 8, i % 50 + 1] for i in range(600)]

    def patterns(core) -> Counter:
        outputs = run_requests(core, prompts, params)
        counts = Counter()
        for prompt, output in zip(prompts, outputs):
            context = list(prompt)
            pattern = []
            for token in output:
                pattern.append(token == fake_next_token(np.array(context)))
                context.append(token)
            counts[tuple(pattern)] += 1
        return counts

    plain = patterns(fake_core(max_running_requests=64)[0])
    core, _ = speculating_fake_core(max_running_requests=64)
    speculated = patterns(core)
    assert core.scheduler.num_accepted_tokens > 500
    assert core.scheduler.num_draft_tokens - core.scheduler.num_accepted_tokens > 200
    outcomes = sorted(set(plain) | set(speculated))
    table = np.array([[plain[o] for o in outcomes], [speculated[o] for o in outcomes]])
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    keep = expected.min(0) >= 5  # the chi-square approximation's usual rule
    chi2 = ((table[:, keep] - expected[:, keep]) ** 2 / expected[:, keep]).sum()
    dof = keep.sum() - 1
    # The 0.999 quantile of chi-square is below dof + 4.5 * sqrt(2 dof) + 6 for these dofs
    assert chi2 < dof + 4.5 * np.sqrt(2 * dof) + 6, (chi2, dof, table)
    # ... and always accepting the favourite would be caught: all five taken is ~0.1 of plain
    assert plain[(True,) * 5] < 0.2 * len(prompts)


def test_ngram_index_proposes_what_followed_the_latest_occurrence():
    index = NgramIndex(2, 3)
    seq = Sequence(0, "r", 0, [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2], SamplingParams())
    index.extend(seq)
    assert index.lookup(3) == [3, 4, 5]  # (1, 2) last seen before 3, 4, 5
    seq.output_ids = [3]
    index.extend(seq)
    assert index.lookup(2) == [4, 5]  # (1, 2, 3) -> 4, 5: the longest suffix wins
    seq.output_ids = [3, 7]
    index.extend(seq)
    assert index.lookup(4) == []  # (3, 7) never occurred


def test_the_depth_cap_weighs_expected_tokens_against_measured_step_times():
    speculator = Speculator(OracleProposer(), 8)
    assert speculator._best_cap(1, [0.8], [8]) == 8  # nothing timed yet: try it all
    for _ in range(8):  # rows almost free: a memory-bound decode step
        speculator.observe_step(1, 0.010)
        speculator.observe_step(9, 0.011)
    assert speculator._best_cap(1, [0.8], [8]) == 8
    assert speculator._best_cap(1, [0.8], [3]) == 3
    speculator = Speculator(OracleProposer(), 8)
    for rows in (32, 64, 128, 320) * 3:  # a compute-bound step: a row costs 1 ms
        speculator.observe_step(rows, 0.010 + rows * 0.001)
    assert speculator._best_cap(32, [0.5] * 32, [8] * 32) == 0
    assert speculator._best_cap(32, [0.99] * 32, [1] * 32) == 1  # ... unless all are accepted
    times = StepTimes()
    for seconds in (0.5, 0.02, 0.02):  # the first step of a shape may build its kernels
        times.observe(4, seconds)
    times.observe(12, 0.01)  # timed once: not yet weighed
    # One count timed: the same time up to twice the count, in proportion beyond
    assert times.estimate(np.array([2, 8, 16])).tolist() == pytest.approx([0.02, 0.02, 0.04])
    for rows, seconds in [(8, 0.04), (12, 0.05), (16, 0.08)] * 6:
        times.observe(rows, seconds)
    # The least-squares line through the medians of 4, 8, 12 and 16 rows: 4.75 ms a row
    assert times.estimate(np.array([2, 20])).tolist() == pytest.approx([0.0095, 0.095])


class Placeholders:
    """A draft model's proposer without the model: placeholders for drafts, and the tokens
    each sequence's draft has not computed (one by default: a caught-up sequence's newest)."""

    def __init__(self, behind: dict[int, int] | None = None) -> None:
        self.behind_by_id = behind or {}

    def behind(self, seq: Sequence) -> int:
        return self.behind_by_id.get(seq.seq_id, 1)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [[0] * k for k in ks]


def test_a_new_launch_weighs_drafts_by_the_step_times_the_last_one_kept(tmp_path):
    """`Speculator.save` keeps the step times (and a draft model's costs); a speculator
    started on the same file weighs its first drafts by them (no "try it all"), and a file
    that does not read as step times is as none."""
    times_file = tmp_path / "speculation" / "times.json"
    first = Speculator(OracleProposer(), 8, times_file)
    for rows in (32, 64, 128, 320) * 3:  # compute-bound: drafts do not pay
        first.observe_step(rows, 0.010 + rows * 0.001)
    first.save()
    second = Speculator(OracleProposer(), 8, times_file)
    assert second.times.samples() == first.times.samples()
    assert second._best_cap(32, [0.5] * 32, [8] * 32) == 0
    times_file.write_text("not step times")
    assert Speculator(OracleProposer(), 8, times_file)._best_cap(32, [0.5] * 32, [8] * 32) == 8
    # A draft model's forwards and catch-ups are kept beside the steps
    drafting = Speculator(Placeholders(), 8, times_file, draft_model=True)
    for rows in (1, 2) * 3:
        drafting.observe_step(rows, 0.010)
        drafting.draft.observe([200, rows], [0.1, 0.001 * rows], short_catch_up=False)
    drafting.save()
    kept = Speculator(Placeholders(), 8, times_file, draft_model=True).draft
    assert kept.samples() == drafting.draft.samples() and kept.forwards.samples()
    assert kept.catch_up_seconds(np.array([400])).tolist() == pytest.approx([0.2])


def test_step_times_are_kept_per_model_and_settings(tmp_path, monkeypatch, model_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = EngineConfig.create(model=model_path, speculative="ngram")
    assert step_times_file(config) == step_times_file(EngineConfig.create(
        model=model_path, speculative="ngram"))
    assert step_times_file(config).is_relative_to(tmp_path)
    for other in (dict(tp=2), dict(dtype="fp32"), dict(max_total_tokens=4096)):
        assert step_times_file(EngineConfig.create(model=model_path, speculative="ngram",
                                                   **other)) != step_times_file(config)


class FixedProposer:
    """Proposes `k` copies of token 1."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [[1] * k for k in ks]


class AskedProposer(FixedProposer):
    """Records the depths it is asked for."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        self.asked.append(list(ks))
        return super().propose(seqs, ks)


def test_a_proposer_is_asked_only_for_the_depth_a_step_pays_for():
    """Where rows cost what tokens are worth (a compute-bound batch), a costly proposer (a
    draft model) is asked for nothing; where rows are almost free, for the whole depth."""
    for row_ms, expected in [(1.0, 0), (0.01, 4)]:
        proposer = AskedProposer()
        speculator = Speculator(proposer, 4)
        for rows in (32, 64, 160) * 3:
            speculator.observe_step(rows, 0.010 + rows * row_ms / 1000)
        seqs = [Sequence(i, "r", i, [1, 2, 3], SamplingParams(max_new_tokens=100))
                for i in range(32)]
        speculator.propose(seqs)
        assert proposer.asked == [[expected] * 32]


def ledger_run(accepted: int, steps: int, draft_row_ms: float) -> list[int]:
    """Draft lengths one sequence proposes over `steps` decode steps, each draft accepting its
    first `accepted` tokens, a step costing 10 ms plus `draft_row_ms` per draft row."""
    speculator = Speculator(FixedProposer(), 4)
    for rows in (1, 5) * 3:  # the line is known: a 1-row step and a 5-row one timed
        speculator.observe_step(rows, 0.010 + (rows - 1) * draft_row_ms / 1000)
    seq = Sequence(0, "r", 0, [1, 2, 3], SamplingParams(max_new_tokens=10_000))
    seq.speculation = SequenceSpeculation(AcceptanceRate(0.9))  # it expects to win
    lengths = []
    for _ in range(steps):
        speculator.propose([seq])
        lengths.append(len(seq.draft))
        speculator.observe_step(1 + len(seq.draft), 0.010 + len(seq.draft) * draft_row_ms / 1000)
        seq.output_ids += [1] * (1 + min(accepted, len(seq.draft)))
        seq.speculation.acceptance.rate = 0.9  # the rate alone would keep proposing
    return lengths


def test_a_sequence_whose_drafts_lose_time_stops_proposing_for_a_while():
    """Drafts accepted (1 token of 4, each row costing a fifth of a step) earn more than they
    cost: proposed at every step. None accepted, rows costing a tenth of a step: after
    LEDGER_DRAFTS verified drafts the sequence pauses PAUSE_STEPS steps, then twice as long."""
    assert all(length == 4 for length in ledger_run(1, 40, 2.0))
    lengths = ledger_run(0, LEDGER_DRAFTS + 3 * PAUSE_STEPS + LEDGER_DRAFTS + 2, 1.0)
    first_pause = lengths[LEDGER_DRAFTS:LEDGER_DRAFTS + PAUSE_STEPS]
    assert all(lengths[:LEDGER_DRAFTS]) and not any(first_pause)
    second = LEDGER_DRAFTS + PAUSE_STEPS + LEDGER_DRAFTS
    assert all(lengths[LEDGER_DRAFTS + PAUSE_STEPS:second])
    assert not any(lengths[second:second + 2 * PAUSE_STEPS])


# The real model: the engine core over a model runner in this process (tp 1)

COPY = ("The quick brown fox jumps over the lazy dog. " * 6 + "Now write that sentence three "
        "times: The quick brown fox")


def test_the_real_model_decodes_as_without_speculation(runner, tokenizer, prompt_ids):
    prompts = [tokenizer(COPY)["input_ids"], *prompt_ids[:2], tokenizer(COPY)["input_ids"]]
    params = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)

    def generate(speculative: str, cache_tokens: int) -> tuple[list[list[int]], EngineCore]:
        config = EngineConfig.create(model=runner.engine.model, dtype="fp32",
                                     max_total_tokens=cache_tokens, speculative=speculative)
        core = EngineCore(config, runner.config, RunnerExecutor(runner))
        return run_requests(core, prompts, params, eos=2), core

    plain, _ = generate("off", 4096)
    for cache_tokens in (4096, 160):  # the second preempts
        outputs, core = generate("ngram", cache_tokens)
        assert outputs == plain
        assert core.scheduler.num_accepted_tokens > 20
        assert core.scheduler.prefix_hits > 0
        assert (core.scheduler.num_preemptions > 0) == (cache_tokens == 160)


@pytest.fixture(scope="module")
def tiny_with_draft(tiny_llama, tmp_path_factory, tokenizer):
    """The tiny Llama as one rank in this process with two draft models beside it: itself
    (whose greedy proposals it accepts) and another random one (whose proposals it rejects)."""
    from braid.distributed.comm import SkipCommunicator
    from braid.loader.model_config import load_model_config
    from braid.random_model import make_random_model
    from braid.worker.draft import RankDraft
    from braid.worker.model_runner import ModelRunner

    other = str(make_random_model("llama", "tiny", str(tmp_path_factory.mktemp("other") / "m"),
                                  seed=1, tokenizer=tokenizer))
    # Eager (no fused kernels to compile: seconds saved where no other test compiled them)
    config = EngineConfig.create(model=tiny_llama, dtype="fp32", max_total_tokens=4096,
                                 compile="off")
    runner = ModelRunner(config, load_model_config(tiny_llama), SkipCommunicator(0, 1))
    drafts = {name: RankDraft(config.replace(speculative="draft", draft_model=path), runner.comm)
              for name, path in (("same", tiny_llama), ("other", other))}
    return runner, drafts


@pytest.mark.parametrize("draft", ["same", "other"])
def test_a_draft_model_in_the_ranks_decodes_as_without_speculation(tiny_with_draft, draft):
    """The draft model beside the model (`braid.worker.draft`) proposes, the step verifies:
    greedy and seeded sampled outputs equal plain decoding's, with a prefix shared between
    requests, and with a cache so small that sequences are preempted and recomputed (the
    draft's positions roll back with the model's). The model as its own draft has every greedy
    proposal accepted; another random model almost none."""
    runner, drafts = tiny_with_draft
    shared = list(range(300, 340))
    prompts = [shared + [7, 8], list(range(1000, 1003)), list(range(7, 300, 3)), shared + [9]]

    def generate(params, cache_tokens: int, **speculation):
        config = EngineConfig.create(model=runner.engine.model, dtype="fp32",
                                     max_total_tokens=cache_tokens, speculative_tokens=4,
                                     compile="off", **speculation)
        core = EngineCore(config, runner.config, RunnerExecutor(runner))
        if core.speculator is not None:  # priced as free: it drafts at every step
            core.speculator = Speculator(core.speculator.proposer, 4)
            # ... but each of the draft's forwards is timed, for its price
            core.speculator.observe_draft = lambda plan, seconds: timed.append(
                len(plan.forward_rows()) == len(seconds) and all(s > 0 for s in seconds))
        return run_requests(core, prompts, params, eos=-1), core.scheduler

    timed: list[bool] = []

    runner.draft = drafts[draft]
    try:
        for params in (SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True),
                       SamplingParams(max_new_tokens=40, temperature=0.05, seed=7,
                                      ignore_eos=True)):
            plain, _ = generate(params, 4096)
            for cache_tokens in (4096, 160):
                outputs, scheduler = generate(params, cache_tokens, speculative="draft",
                                              draft_model=drafts[draft].runner.engine.model)
                assert outputs == plain
                assert scheduler.num_draft_tokens > 0 and timed and all(timed)
                if draft == "same" and params.temperature == 0:
                    assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens
                elif draft == "same":  # sampled: some accepted, some not
                    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
                assert scheduler.prefix_hits > 0
                assert (scheduler.num_preemptions > 0) == (cache_tokens == 160)
    finally:
        runner.draft = None


def test_the_drafts_catch_up_computes_each_token_once():
    """The draft computes only for the sequences that propose: each catches up on exactly the
    tokens it has not computed (its prompt too, the first time), within the step's budget (a
    sequence further behind proposes nothing and catches up a chunk); a few tokens run as one
    decode row each; a rejected proposal's key is computed again."""
    from braid.engine.draft import RankDraftProposer

    proposer = RankDraftProposer(block_size=16, budget=24)
    short = Sequence(0, "0", 0, list(range(200, 210)), GREEDY, blocks=[1, 5], output_ids=[60])
    long = Sequence(1, "1", 0, list(range(100, 140)), GREEDY, blocks=[2, 3, 4],
                    output_ids=[50])

    def step(k_short: int, k_long: int):
        for seq in (short, long):
            seq.num_computed = seq.num_tokens - 1
        drafts = proposer.propose([short, long], [k_short, k_long])
        for seq, draft in zip((short, long), drafts):
            seq.draft, seq.scheduled_tokens = draft, 1 + len(draft)
        return [len(d) for d in drafts], proposer.plan([short, long], {0, 1})

    # The short one's 11 tokens fit the budget of 24; the long one's 41 do not: 13 of them
    lengths, plan = step(3, 3)
    assert lengths == [3, 0]
    assert plan.catch_up.input_ids.tolist() == list(range(200, 210)) + [60] + list(range(100, 113))
    assert plan.catch_up.q_lens.tolist() == [11, 13]
    assert plan.catch_up.logit_rows.tolist() == [10] and plan.proposers.tolist() == [0]
    assert plan.rows.tolist() == [0] and plan.lengths.tolist() == [3]

    # The model accepted one proposal (61) and sampled 62: the draft computed 61's key as a
    # proposal; the long one catches up 23 more
    short.output_ids += [61, 62]
    long.output_ids += [51]
    lengths, plan = step(2, 2)
    assert lengths == [2, 0]
    assert plan.catch_up.input_ids.tolist() == [62] + list(range(113, 136))
    assert plan.catch_up.positions.tolist()[0] == 12

    # Both proposals accepted (63, 64) and 65 sampled: 64 and 65 are new to the draft, one
    # decode row each; the long one's last 7 tokens now fit, and it proposes
    short.output_ids += [63, 64, 65]
    long.output_ids += [52]
    lengths, plan = step(1, 1)
    assert lengths == [1, 1]
    catch_up = plan.catch_up
    assert catch_up.input_ids.tolist() == [64, 65, 136, 137, 138, 139, 50, 51, 52]
    assert catch_up.q_lens.tolist() == [1, 1, 7] and catch_up.kv_lens.tolist() == [15, 16, 43]
    assert catch_up.logit_rows.tolist() == [1, 8] and plan.proposers.tolist() == [0, 1]
    assert plan.rows.tolist() == [0, 2]

    # Both rejected: their newest alone, decode-shaped (every row a logit row)
    short.output_ids += [70]
    long.output_ids += [71]
    lengths, plan = step(1, 1)
    assert plan.catch_up.input_ids.tolist() == [70, 71]
    assert plan.catch_up.logit_rows is None and plan.proposers.tolist() == [0, 1]

    # Asked for nothing: the draft does nothing, and catches up when asked again
    short.output_ids += [80]
    long.output_ids += [81]
    assert step(0, 0) == ([0, 0], None)
    short.output_ids += [90]
    assert step(1, 0)[1].catch_up.input_ids.tolist() == [80, 90]


def test_ngram_proposer_skips_a_sequence_without_a_match():
    proposer = NgramProposer(2, 4)
    seq = Sequence(0, "r", 0, [1, 2, 3, 4], SamplingParams())
    seq.speculation = SequenceSpeculation(AcceptanceRate())
    assert proposer.propose([seq], [4]) == [[]]



def test_speculation_flags_are_checked():
    for bad, flag in [({"speculative": "draft"}, "--draft-model"),
                      ({"draft_model": "x"}, "--draft-model"),
                      ({"speculative": "medusa"}, "--speculative"),
                      ({"speculative_tokens": 0}, "--speculative-tokens"),
                      ({"ngram_min": 3, "ngram_max": 2}, "--ngram-min")]:
        with pytest.raises(UserError, match=flag):
            EngineConfig.create(model="m", **bad)


def test_a_draft_model_that_cannot_draft_is_refused_by_name(tiny_llama):
    """Before the ranks start: a draft with another vocabulary or a shorter context."""
    from dataclasses import replace

    from braid.engine.draft import check_draft_model
    from braid.loader.model_config import load_model_config

    target = load_model_config(tiny_llama)
    config = EngineConfig.create(model=tiny_llama, speculative="draft", draft_model=tiny_llama)
    check_draft_model(config, target)  # the model itself drafts
    for changed, words in (({"vocab_size": target.vocab_size + 1}, "vocabulary of"),
                           ({"max_position_embeddings": 2 * target.max_position_embeddings},
                            "context of")):
        with pytest.raises(UserError, match=f"--draft-model .* {words}"):
            check_draft_model(config, replace(target, **changed))


def test_a_draft_model_is_priced_by_its_forwards():
    """A draft model proposes nothing until plain steps are timed, then for one sequence, one
    token, until its forwards are; then each level of depth costs a forward of its rows: a
    cheap draft goes as deep as allowed where rows are almost free, a dear one not at all."""
    for forward_ms, depth in ((1, 16), (50, 0)):
        speculator = Speculator(Placeholders(), 16, draft_model=True)
        seqs = [Sequence(i, str(i), i, [1, 2, 3], GREEDY) for i in range(2)]
        drafts = []
        for _ in range(2 * MIN_TIMINGS):
            speculator.propose(seqs)
            drafts.append([len(seq.draft) for seq in seqs])
            if any(drafts[-1]):
                speculator.draft.observe([1], [forward_ms / 1000], short_catch_up=True)
            speculator.observe_step(2 + sum(drafts[-1]), 0.010)
        assert drafts == [[0, 0]] * MIN_TIMINGS + [[1, 0]] * MIN_TIMINGS
        for rows in (2, 4, 8, 18) * 4:  # a memory-bound step: 10 ms whatever its rows
            speculator.observe_step(rows, 0.010)
        speculator.propose(seqs)
        assert [len(seq.draft) for seq in seqs] == [depth] * 2


def test_a_draft_model_catches_up_only_where_the_rest_of_the_output_repays_it():
    """Two sequences whose prompts the draft has not read (256 tokens, 0.5 ms a token to
    catch up): the one with 1,000 tokens left proposes, the one with 8 left does not (its
    catch-up costs more than drafting would save it); a caught-up one proposes either way."""
    speculator = Speculator(Placeholders({0: 256, 1: 256}), 16, draft_model=True)
    for rows in (2, 4, 8, 18) * 3:  # a memory-bound step: 10 ms whatever its rows
        speculator.observe_step(rows, 0.010)
    for count in (1, 2, 4, 8) * 3:
        speculator.draft.observe([count], [0.001], short_catch_up=True)
    speculator.draft.observe([256], [0.128], short_catch_up=False)
    seqs = [Sequence(i, str(i), i, [1, 2, 3], SamplingParams(max_new_tokens=tokens))
            for i, tokens in enumerate((8, 1000, 8))]
    speculator.propose(seqs)
    assert [len(seq.draft) > 0 for seq in seqs] == [False, True, True]
