"""Overlap on vs off on the real model: same greedy tokens, logits within 2e-3 (fp32)."""

from __future__ import annotations

import pytest
import torch
from conftest import slow

from braid import LLM, SamplingParams
from braid.config import KVCacheConfig, SchedulerConfig, StepSwitches
from braid.worker.split import split_step

# the default of --tbo-token-distribution-threshold
THRESHOLD = StepSwitches().tbo_token_distribution_threshold

TOLERANCE = 2e-3


def logits_with(llm: LLM, overlap: str, prompts) -> list[torch.Tensor]:
    llm.switch(overlap=overlap)
    return llm.prompt_logits(prompts)


def greedy_with(llm: LLM, overlap: str, prompts) -> list[list[int]]:
    llm.switch(overlap=overlap)
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("tp,comm", [(2, "shm"), slow(2, "torch"), slow(3, "shm"),
                                     slow(3, "torch")])
def test_overlap_on_equals_off(tp, comm, model_path, prompt_ids):
    mixed = prompt_ids  # lengths 1..~50: the long prompt is cut in two
    balanced = [prompt_ids[2], prompt_ids[2][::-1]]  # cut between the two sequences
    single = [prompt_ids[3]]  # one prompt: two-chunk
    # No prefix cache: the second run of the prompts prefills them in full, as the first did.
    # The blocks' products as the dequantized weights': int8 inputs (the AVX2 default) serve
    # GEMMs of up to 32 rows, so the prompts' logits, split or not, would meet two arithmetics.
    with LLM(model_path, tp=tp, dtype="fp32", comm=comm, prefix_caching=False,
             block_inputs="float") as llm:
        for prompts in (mixed, balanced, single):
            on, off = logits_with(llm, "on", prompts), logits_with(llm, "off", prompts)
            for a, b in zip(on, off):
                assert torch.equal(a.argmax(-1), b.argmax(-1))
                assert (a - b).abs().max().item() <= TOLERANCE
        # Prefill then decode steps, each split (decode: half the sequences each).
        assert greedy_with(llm, "on", mixed) == greedy_with(llm, "off", mixed)


def test_the_cases_really_split(prompt_ids):
    """Guards the test above: its batches do take the split paths it claims to cover."""
    from braid.engine.kv_cache import BlockManager
    from braid.engine.plan import build_plan
    from braid.engine.request import Sequence
    from braid.engine.scheduler import Scheduler

    def plan_for(prompts):
        scheduler = Scheduler(BlockManager(KVCacheConfig(4096, 16)),
                              SchedulerConfig(max_num_batched_tokens=8192,
                                              max_running_requests=64), max_context=8192)
        for i, p in enumerate(prompts):
            scheduler.add(Sequence(i, str(i), 0, list(p), SamplingParams(temperature=0)))
        return build_plan(scheduler.schedule(), 16, 0)[0]

    assert split_step(plan_for(prompt_ids), THRESHOLD).a_ends_mid_sequence
    assert not split_step(plan_for([prompt_ids[2], prompt_ids[2][::-1]]),
                          THRESHOLD).a_ends_mid_sequence
    assert split_step(plan_for([prompt_ids[3]]), THRESHOLD).a_ends_mid_sequence


def test_overlap_splits_mixed_steps_without_changing_tokens(model_path, prompt_ids):
    """A small step budget makes steps that carry decodes beside prompt chunks; overlapping
    every step (its two micro-batches each with their decode and prompt groups) must give the
    tokens of the plain path."""
    prompts = [prompt_ids[3], prompt_ids[1], prompt_ids[2], prompt_ids[3][5:]]
    # Exact products over the blocks (as above): int8 inputs would turn the paths' last-bit
    # differences into a whole rounding step now and then, and a near tie into another token
    with LLM(model_path, tp=2, dtype="fp32", prefix_caching=False,
             max_num_batched_tokens=24, block_inputs="float") as llm:
        off = greedy_with(llm, "off", prompts)
        before = llm.core.num_steps_overlap
        assert greedy_with(llm, "on", prompts) == off
        assert llm.core.num_steps_overlap > before
