"""The compiled path against transformers and against itself, at tp 1, 2 and 3 (fp32): prompt
steps through compiled pieces, decode steps through the decode graph, two-batch overlap through
the staged pieces; each answers as transformers and as the other does.

The model is a random two-layer Llama with SmolLM2's heads (`tiny_llama`): compiled in seconds,
where the embedded model's 30 layers take minutes per rank; the eager path keeps its parity
tests on the embedded model (test_hf_parity)."""

from __future__ import annotations

import pytest
import torch
from conftest import slow

from braid import LLM, SamplingParams
from braid.engine.speculation import NgramProposer, Speculator

LOGIT_TOLERANCE = 2e-3
PROMPTS = [list(range(500, 540)), list(range(1000, 1003)), list(range(7, 300, 3)), [42]]


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama):
    """transformers' fp32 logits at every prompt position and 12 greedy tokens per prompt."""
    from conftest import hf_greedy
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = [model(torch.tensor([ids])).logits[0].float() for ids in PROMPTS]
        greedy = [hf_greedy(model, ids, 12) for ids in PROMPTS]
    return logits, greedy


def check_logits(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(ours, reference)):
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"prompt {i}: top-1 differs"
        diff = (a - b).abs().max().item()
        assert diff <= LOGIT_TOLERANCE, f"prompt {i}: max |logit diff| {diff:.2e}"


def greedy(llm: LLM, overlap: str) -> list[list[int]]:
    llm.switch(overlap=overlap)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("tp, comm", [slow(1, "auto"), (2, "shm"), slow(2, "torch"), slow(3, "shm"),
                                      slow(3, "torch")])
def test_compiled_steps_match_transformers_with_and_without_overlap(tp, comm, tiny_llama,
                                                                    tiny_reference):
    """`--compile on`: logits and greedy tokens equal transformers'; at tp > 1 overlap on and
    off give the same tokens and logits within the tolerance, every step on a compiled path."""
    ref_logits, ref_greedy = tiny_reference
    # The model is also its own draft model (`--speculative draft`), held back until the end
    with LLM(tiny_llama, tp=tp, dtype="fp32", comm=comm, compile="on", prefix_caching=False,
             speculative="draft", draft_model=tiny_llama) as llm:
        drafting, llm.core.speculator = llm.core.speculator, None
        check_logits(llm.prompt_logits(PROMPTS), ref_logits)
        assert greedy(llm, "off") == ref_greedy
        paths = {"off": dict(llm.core.steps_by_path)}
        if tp > 1:
            llm.switch(overlap="on")
            check_logits(llm.prompt_logits(PROMPTS), ref_logits)
            assert greedy(llm, "on") == ref_greedy
        paths["all"] = dict(llm.core.steps_by_path)
        # Speculative decoding: k + 1 decode rows per sequence through the same graph (and
        # split between two micro-batches under overlap) decode the same tokens
        scheduler = llm.core.scheduler
        llm.core.speculator = Speculator(NgramProposer(1, 4), 8)
        for overlap in ("off", "on") if tp > 1 else ("off",):
            assert greedy(llm, overlap) == ref_greedy
        assert scheduler.num_draft_tokens > 0  # (the random model copies little)
        assert llm.core.steps_by_path["graph"] > paths["all"]["graph"]
        # ... and so do the proposals of the draft model in the ranks (all accepted), whose
        # own steps are compiled too (priced as free, so that it drafts at every step)
        llm.core.speculator = Speculator(drafting.proposer, 8)
        for overlap in ("off", "on") if tp > 1 else ("off",):
            accepted, drafted = scheduler.num_accepted_tokens, scheduler.num_draft_tokens
            assert greedy(llm, overlap) == ref_greedy
            assert (scheduler.num_accepted_tokens - accepted
                    == scheduler.num_draft_tokens - drafted > 0)
    assert set(paths["off"]) == {"pieces", "graph"}  # prompts, decode steps
    assert paths["off"]["graph"] >= 11
    if tp > 1:
        assert set(paths["all"]) == {"pieces", "graph", "pieces+overlap"}
        assert paths["all"]["pieces+overlap"] >= 12


@pytest.mark.slow
def test_compiled_steps_read_an_int8_kv_cache_as_eager_steps_do(tiny_llama):
    """With an int8 KV cache, eager decode attends over the dequantized blocks and the decode
    graph's C++ operator over the int8 ones with their scales: the same greedy tokens."""
    results = {}
    for mode in ("off", "on"):
        with LLM(tiny_llama, dtype="fp32", compile=mode, kv_cache_dtype="int8") as llm:
            results[mode] = greedy(llm, "off")
    assert results["on"] == results["off"]
