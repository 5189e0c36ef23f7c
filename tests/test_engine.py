"""Engine core, paged KV cache, prefix cache and sampler, on the real model in this process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_utils import RunnerExecutor, run_requests

from braid.config import EngineConfig
from braid.distributed.comm import SkipCommunicator
from braid.engine.core import EngineCore
from braid.engine.request import Request, SamplingParams
from braid.errors import UserError
from braid.layers import attention_ops, decode_kernel
from braid.loader.model_config import load_model_config
from braid.step import Penalty, SamplingBatch, StepPlan
from braid.worker.model_runner import ModelRunner
from braid.worker.sampler import postprocess, sample, token_logprobs

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def make_core(runner, **engine_args) -> EngineCore:
    """A fresh engine core (its own scheduler and prefix cache) over the shared runner."""
    config = EngineConfig.create(model=runner.engine.model, dtype="fp32",
                                 **{"max_total_tokens": 4096, **engine_args})
    return EngineCore(config, runner.config, RunnerExecutor(runner))


def generate(runner, prompts, params=GREEDY, **engine_args):
    """Run prompts to completion through a fresh engine core; return outputs and the core."""
    core = make_core(runner, **engine_args)
    return run_requests(core, prompts, params, eos=2), core


@pytest.fixture(scope="module")
def reference(runner, prompt_ids):
    return generate(runner, prompt_ids)[0]


def test_batched_equals_one_at_a_time(runner, prompt_ids, reference):
    alone = [generate(runner, [p])[0][0] for p in prompt_ids]
    assert alone == reference
    # All four prompts fit one prefill step, then every step decodes all of them.
    assert generate(runner, prompt_ids)[1].num_steps == GREEDY.max_new_tokens


def test_chunked_prefill_attends_to_the_cached_prefix(runner, prompt_ids, reference):
    # A 7-token budget cuts the longer prompts into chunks; each chunk reads the earlier ones'
    # KV from the paged cache.
    outputs, core = generate(runner, prompt_ids, max_num_batched_tokens=7)
    assert outputs == reference
    assert core.num_steps > len(reference[0]) + 4  # the chunks really happened


@pytest.mark.parametrize("steps", ["one prompt a step", "prompts together", "7-token chunks"])
def test_blocked_prefill_attention_answers_as_sdpa(runner, prompt_ids, reference, steps,
                                                   monkeypatch):
    """The prefill kernel of bf16 hosts without AMX, forced on here in fp32, gives SDPA's
    tokens: a fresh prompt alone (the batched call), prompts of unequal lengths together (one
    call each) and chunks that attend to their cached prefix."""
    calls = []

    def blocked(*args):
        calls.append(args[0].shape)
        return attention_ops.blocked_causal_attention(*args)

    for attn in runner.model.attention_layers():  # as a plan of such a host chooses it
        monkeypatch.setattr(attn, "prefill_kernel", blocked)
    if steps == "one prompt a step":
        outputs = [generate(runner, [p])[0][0] for p in prompt_ids]
    else:
        budget = 7 if steps == "7-token chunks" else None
        outputs = generate(runner, prompt_ids, max_num_batched_tokens=budget)[0]
    assert outputs == reference
    assert calls


def test_preemption_under_a_small_cache_loses_nothing(runner, prompt_ids):
    # Three 14-token prompts fit 4 blocks of 16 at first; generating 40 tokens each, they grow
    # to 4 blocks apiece: someone must be preempted and recomputed later.
    prompts = [prompt_ids[3][i:i + 14] for i in range(3)]
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    alone = [generate(runner, [p], params)[0][0] for p in prompts]
    outputs, core = generate(runner, prompts, params, max_total_tokens=64)
    assert core.scheduler.num_preemptions > 0
    assert outputs == alone


def test_request_too_large_for_the_cache_is_refused_and_the_engine_goes_on(runner, prompt_ids):
    # The case that used to preempt itself and break the engine: prompt + max_new_tokens
    # exceeds the 64-token cache.
    core = make_core(runner, max_total_tokens=64)
    too_long = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    with pytest.raises(UserError, match="exceeds the KV cache .*--max-total-tokens"):
        core.add(Request("big", [1] * 40, too_long))
    assert run_requests(core, [prompt_ids[1]], GREEDY, eos=2)[0]
    assert not core.has_work


def test_prefix_cache_computes_only_the_new_blocks(runner, tokenizer):
    """The same 5-shot prefix twice: the second prefill computes only the blocks after the
    shared ones, and the next-token distribution is the one computed from scratch."""
    shots = "".join(f"Question: What is {a} plus {b}?\nAnswer: {a + b}\n\n"
                    for a, b in [(2, 3), (7, 5), (10, 4), (6, 6), (9, 8)])
    first = tokenizer(shots + "Question: What is 3 plus 4?\nAnswer:")["input_ids"]
    second = tokenizer(shots + "Question: What is 8 plus 1?\nAnswer:")["input_ids"]
    params = SamplingParams(max_new_tokens=1, temperature=0, logprobs=20)
    core = make_core(runner)
    cold = make_core(runner, prefix_caching=False)

    def first_token(core, prompt):
        core.add(Request("q", prompt, params))
        (delta,) = core.step()
        assert not core.has_work
        return delta

    first_token(core, first)
    tokens_before = core.scheduler.prefix_hits
    warm = first_token(core, second)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b) // 16 * 16
    assert shared >= 48
    assert core.scheduler.prefix_hits - tokens_before == shared
    assert warm.num_cached_tokens == shared
    reference = first_token(cold, second)
    assert reference.num_cached_tokens == 0
    assert warm.new_token_ids == reference.new_token_ids
    (warm_lp,), (ref_lp,) = warm.logprobs, reference.logprobs
    assert [t for t, _ in warm_lp.top] == [t for t, _ in ref_lp.top]
    assert np.allclose([v for _, v in warm_lp.top], [v for _, v in ref_lp.top], atol=1e-4)


def sampling_batch(n, temperature=1.0, top_k=0, top_p=1.0, seed=None, position=0, min_p=0.0,
                   penalties=None, banned=(), biases=()):
    return SamplingBatch(np.full(n, temperature, np.float32), np.full(n, top_k, np.int64),
                         np.full(n, top_p, np.float32), np.full(n, min_p, np.float32),
                         [seed] * n, np.full(n, position), np.full(n, -1), [()] * n,
                         penalties or [None] * n, [banned] * n, [biases] * n)


def draw(logits, batch, gen) -> list[int]:
    tokens, errors = sample(logits, batch, gen)
    assert not errors
    return tokens


def test_sampler_greedy_topk1_tiny_topp_and_high_minp_pick_the_argmax():
    logits = torch.randn(6, 100)
    gen = torch.Generator().manual_seed(0)
    argmax = logits.argmax(-1).tolist()
    assert draw(logits, sampling_batch(6, temperature=0), gen) == argmax
    assert draw(logits, sampling_batch(6, top_k=1), gen) == argmax
    assert draw(logits, sampling_batch(6, top_p=1e-6), gen) == argmax
    assert draw(logits, sampling_batch(6, min_p=1.0), gen) == argmax


def test_greedy_picks_the_first_greatest_logit_as_torch_does():
    """The CPU fp32 argmax (numpy's) and torch's max agree on ties (the first index); a NaN
    row fails alone; the same for rows that are views into a wider tensor, and for bf16
    logits (torch's path)."""
    logits = torch.randn(5, 3000)
    logits[0, [7, 2000]] = 50.0  # a tie
    logits[1] = 1.0  # all equal
    logits[2, [900, 400]] = float("nan")
    logits[3, -1] = float("inf")
    for rows in (logits, logits[:, 100:], logits.bfloat16()):
        params = sampling_batch(len(rows), temperature=0)
        tokens, errors = sample(rows, params, torch.Generator())
        expected = rows.max(dim=-1).indices.tolist()
        assert [t for i, t in enumerate(tokens) if i != 2] == expected[:2] + expected[3:]
        assert tokens[2] is None and set(errors) == {2}
    assert sample(logits, sampling_batch(5, temperature=0), torch.Generator())[0][:2] == [7, 0]


def test_sampler_respects_top_k_min_p_and_seeds():
    logits = torch.zeros(1, 50)
    logits[0, :5] = 10.0  # five equally likely tokens
    gen = torch.Generator().manual_seed(0)
    draws = {draw(logits, sampling_batch(1, top_k=3), gen)[0] for _ in range(60)}
    assert draws <= {0, 1, 2, 3, 4} and len(draws) <= 3
    logits[0, 5:10] = 8.0  # 7x less likely than the first five
    draws = {draw(logits, sampling_batch(1, min_p=0.2), gen)[0] for _ in range(100)}
    assert draws == {0, 1, 2, 3, 4}
    seeded = [draw(logits, sampling_batch(1, seed=7, position=p), gen)[0] for p in range(20)]
    again = [draw(logits, sampling_batch(1, seed=7, position=p), gen)[0] for p in range(20)]
    assert seeded == again and len(set(seeded)) > 1
    huge = [draw(logits, sampling_batch(1, seed=(1 << 63) - 1, position=p), gen)[0]
            for p in range(3)]
    assert len(huge) == 3


def test_sampler_distribution_follows_temperature():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(1)
    counts = np.bincount([draw(logits, sampling_batch(1), gen)[0] for _ in range(2000)],
                         minlength=3) / 2000
    assert np.allclose(counts, [0.7, 0.2, 0.1], atol=0.04)


def test_sampler_penalties_and_banned_tokens():
    gen = torch.Generator()
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0]])
    # Token 0 was generated twice: frequency 0.8 x 2 + presence 0.5 puts it below token 1.
    penalty = Penalty(1.0, 0.5, 0.8, np.array([3]), np.array([0, 0]))
    assert draw(logits, sampling_batch(1, temperature=0, penalties=[penalty]), gen) == [1]
    # Repetition 2 halves positive logits of seen tokens (prompt and output): 4 -> 2 < 3.
    penalty = Penalty(2.0, 0.0, 0.0, np.array([0]), np.array([], dtype=np.int64))
    assert draw(logits, sampling_batch(1, temperature=0, penalties=[penalty]), gen) == [1]
    assert draw(logits, sampling_batch(1, temperature=0, banned=(0, 1)), gen) == [2]


def test_logit_bias_moves_the_choice():
    gen = torch.Generator()
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0]])
    assert draw(logits, sampling_batch(1, temperature=0, biases=((3, 6.0),)), gen) == [3]
    assert draw(logits, sampling_batch(1, temperature=0, biases=((0, -100.0),)), gen) == [1]
    # -100 bans in practice when sampling too (OpenAI's meaning)
    assert set(draw(torch.zeros(64, 4), sampling_batch(64, biases=((0, -100.0), (1, -100.0))),
                    gen)) <= {2, 3}


def test_a_row_whose_parameters_fail_fails_alone():
    # A banned id past the vocabulary (as a stop token id the API forgot to check would be)
    # fails its row; before, the exception ended rank 0, and with it the server.
    batch = sampling_batch(3, temperature=0)
    batch.banned[1] = (100_000_000,)
    batch.biases[2] = ((7, 100.0),)
    batch.num_logprobs[:] = 2
    batch.scored_ids[0] = (5, 999_999)
    plan = StepPlan(*(np.zeros(3, np.int64),) * 6, sample_rows=np.arange(3), sampling=batch)
    result = postprocess(torch.randn(3, 20), plan, torch.Generator())
    assert result.tokens[0] is None and "scoring" in result.errors[0]
    assert result.tokens[1] is None and "sampling parameters" in result.errors[1]
    assert result.tokens[2] == 7 and set(result.errors) == {0, 1}
    assert result.logprobs[2].token_id == 7 and result.logprobs[0] is None


def test_degenerate_float_parameters_still_sample():
    # Found by the API fuzzer: a top_p of 5e-324 is 0 in float32 and dropped every token (NaN,
    # a 500); a temperature below 1e-5 overflowed the division; a repetition penalty of
    # 5e-324 made the penalized logits infinite.
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert draw(logits, sampling_batch(1, top_p=5e-324), torch.Generator()) == [1]
    assert SamplingParams(temperature=1e-40).temperature == 0.0
    with pytest.raises(UserError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=5e-324)


def test_a_row_with_nan_logits_fails_alone():
    logits = torch.randn(3, 20)
    logits[1] = float("nan")
    for temperature in (0.0, 1.0):
        tokens, errors = sample(logits, sampling_batch(3, temperature=temperature),
                                torch.Generator())
        assert tokens[1] is None and "NaN" in errors[1]
        assert tokens[0] is not None and tokens[2] is not None and set(errors) == {1}


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    (entry,) = token_logprobs(logits, [2], [2])
    expected = torch.log_softmax(logits, -1)[0]
    assert entry.token_id == 2 and abs(entry.logprob - expected[2].item()) < 1e-6
    assert [t for t, _ in entry.top] == [1, 2]
    assert token_logprobs(logits, [2], [-1]) == [None]
    (scored,) = token_logprobs(logits, [1], [-1], [(3, 0)])
    assert scored.top == () and [t for t, _ in scored.scored] == [3, 0]
    assert abs(scored.scored[0][1] - expected[3].item()) < 1e-6


@pytest.fixture(scope="module")
def bf16_runner(model_path):
    # eager elementwise ops: the attention is what differs, the compile would take 15 s
    engine = EngineConfig.create(model=model_path, dtype="bf16", compile="off",
                                 max_total_tokens=4096)
    return ModelRunner(engine, load_model_config(model_path), SkipCommunicator(0, 1))


@pytest.mark.skipif(not decode_kernel.prefill_fits(9, 3, 64, torch.bfloat16),
                    reason="the prefill operator needs AVX512-BF16")
@pytest.mark.parametrize("lengths", ["equal", "unequal"])
def test_the_prefill_kernel_is_as_close_to_fp32_as_the_path_it_replaces(
        runner, bf16_runner, prompt_ids, lengths, monkeypatch):
    """bf16 prompt logits with the prefill operator (prompts of equal length in one call,
    unequal ones a call each) stray no further from the fp32 model's than those of the path
    it replaces (SDPA with AMX, the blocked GEMMs without) do, and pick the same next tokens
    nearly everywhere. Straying is the mean absolute error over the prompt's logits: the
    largest one is a single near-tie of bf16 rounding, which swapped sides (0.87 against
    1.35, 2.32 against 1.51) when only the norm's rounding changed."""
    from braid.layers.attention import PREFILL_KERNELS
    from braid.worker.kernels import blocked_prefill_is_faster

    text = sum(prompt_ids, []) * 40
    prompts = ([text[:300], text[50:350]] if lengths == "equal"
               else [text[:300], text[7:144]])
    exact = make_core(runner).prompt_logits(prompts)
    config = EngineConfig.create(model=runner.engine.model, dtype="bf16", max_total_tokens=4096)
    core = EngineCore(config, bf16_runner.config, RunnerExecutor(bf16_runner))
    layers = list(bf16_runner.model.attention_layers())
    assert all(attn.prefill_kernel is decode_kernel.causal_prefill_attention for attn in layers)
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return decode_kernel.causal_prefill_attention(*args)

    for attn in layers:
        monkeypatch.setattr(attn, "prefill_kernel", counted)
    with_kernel = core.prompt_logits(prompts)
    assert len(calls) == len(layers) * (1 if lengths == "equal" else 2)
    replaced = "blocked" if blocked_prefill_is_faster(torch.bfloat16, "cpu") else "sdpa"
    for attn in layers:  # the plan's choice without the operator
        monkeypatch.setattr(attn, "prefill_kernel", PREFILL_KERNELS[replaced])
    without = core.prompt_logits(prompts)
    for kernel, other, fp32 in zip(with_kernel, without, exact):
        kernel_error, other_error = ((x - fp32).abs().mean().item() for x in (kernel, other))
        assert kernel_error <= 1.25 * other_error, (kernel_error, other_error)
        assert (kernel.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.95


@pytest.mark.skipif(not decode_kernel.prefill_fits(9, 3, 64, torch.bfloat16),
                    reason="the prefill operator needs AVX512-BF16")
def test_a_chunk_whose_keys_fit_one_block_prefills_through_the_kernel(bf16_runner, prompt_ids):
    """A 14-token prompt 8 tokens a step: the second chunk's keys, gathered from the cache,
    all sit in one block, which reached the operator with strided head dims (the rank
    failed). Chunked, it decodes as the whole prompt does."""
    prompt = sum(prompt_ids, [])[:14]

    def greedy(budget: int) -> list[int]:
        config = EngineConfig.create(model=bf16_runner.engine.model, dtype="bf16",
                                     max_total_tokens=4096, max_num_batched_tokens=budget)
        core = EngineCore(config, bf16_runner.config, RunnerExecutor(bf16_runner))
        return run_requests(core, [prompt], GREEDY, eos=2)[0]

    assert greedy(8) == greedy(2048)
