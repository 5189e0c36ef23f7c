"""Scheduler, paged KV cache and sampler, on the real model in this process (one rank)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from braid.config import EngineConfig, load_model_config
from braid.distributed.comm import SkipCommunicator
from braid.engine.batch import SamplingBatch
from braid.engine.kv_cache import BlockAllocator
from braid.engine.model_runner import ModelRunner
from braid.engine.request import SamplingParams, Sequence
from braid.engine.sampler import sample
from braid.engine.scheduler import Scheduler

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(model_path):
    engine = EngineConfig(model=model_path, dtype="fp32", max_total_tokens=4096)
    return ModelRunner(engine, load_model_config(model_path), SkipCommunicator(0, 1))


def generate(runner, prompts, params=GREEDY, max_total_tokens=4096, max_prefill_tokens=8192):
    """Run prompts to completion through a fresh scheduler; return outputs and the scheduler."""
    allocator = BlockAllocator(max_total_tokens, runner.engine.block_size)
    scheduler = Scheduler(allocator, max_prefill_tokens, 64, {2}, 8192)
    seqs = [Sequence(i, list(p), params) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.steps = 0
    while scheduler.has_work:
        plan, batch = scheduler.schedule()
        scheduler.commit(batch, runner.step(plan).next_tokens)
        scheduler.steps += 1
    assert allocator.num_free == allocator.num_blocks - 1, "blocks leaked"
    return [s.output_ids for s in seqs], scheduler


@pytest.fixture(scope="module")
def reference(runner, prompt_ids):
    return generate(runner, prompt_ids)[0]


def test_batched_equals_one_at_a_time(runner, prompt_ids, reference):
    alone = [generate(runner, [p])[0][0] for p in prompt_ids]
    assert alone == reference
    # All four prompts fit one prefill step, then every step decodes all of them.
    assert generate(runner, prompt_ids)[1].steps == GREEDY.max_new_tokens


def test_chunked_prefill_attends_to_the_cached_prefix(runner, prompt_ids, reference):
    # A 7-token budget cuts the longer prompts into chunks; each chunk reads the earlier ones'
    # KV from the paged cache.
    outputs, scheduler = generate(runner, prompt_ids, max_prefill_tokens=7)
    assert outputs == reference
    assert scheduler.steps > len(reference[0]) + 4  # the chunks really happened


def test_preemption_under_a_small_cache_loses_nothing(runner, prompt_ids):
    # Three 14-token prompts fit in 4 blocks of 16 at first, but grow to 2 blocks each while
    # decoding: someone must be preempted and recomputed later.
    prompts = [prompt_ids[3][i:i + 14] for i in range(3)]
    alone = [generate(runner, [p])[0][0] for p in prompts]
    outputs, scheduler = generate(runner, prompts, max_total_tokens=64)
    assert scheduler.num_preemptions > 0
    assert outputs == alone


def test_prompt_too_large_for_the_cache_is_refused(runner):
    with pytest.raises(MemoryError, match="--max-total-tokens"):
        generate(runner, [[1] * 100], max_total_tokens=64)


def sampling_batch(n, temperature=1.0, top_k=0, top_p=1.0, seed=None, position=0):
    return SamplingBatch(np.full(n, temperature, np.float32), np.full(n, top_k, np.int64),
                         np.full(n, top_p, np.float32), [seed] * n, np.full(n, position))


def test_sampler_greedy_topk1_and_tiny_topp_pick_the_argmax():
    logits = torch.randn(6, 100)
    gen = torch.Generator().manual_seed(0)
    argmax = logits.argmax(-1)
    assert torch.equal(sample(logits, sampling_batch(6, temperature=0), gen), argmax)
    assert torch.equal(sample(logits, sampling_batch(6, top_k=1), gen), argmax)
    assert torch.equal(sample(logits, sampling_batch(6, top_p=1e-6), gen), argmax)


def test_sampler_respects_top_k_and_seeds():
    logits = torch.zeros(1, 50)
    logits[0, :5] = 10.0  # five equally likely tokens
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, sampling_batch(1, top_k=3), gen)[0]) for _ in range(60)}
    assert draws <= {0, 1, 2, 3, 4} and len(draws) <= 3
    seeded = [int(sample(logits, sampling_batch(1, seed=7, position=p), gen)[0])
              for p in range(20)]
    again = [int(sample(logits, sampling_batch(1, seed=7, position=p), gen)[0])
             for p in range(20)]
    assert seeded == again and len(set(seeded)) > 1


def test_sampler_distribution_follows_temperature():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(1)
    counts = np.bincount([int(sample(logits, sampling_batch(1), gen)[0]) for _ in range(2000)],
                         minlength=3) / 2000
    assert np.allclose(counts, [0.7, 0.2, 0.1], atol=0.04)
