"""The families beyond Llama and DeepSeek against transformers, on random weights that
transformers' own classes made (`braid make-random-model --preset tiny`, fp32): logits and
greedy tokens at tp 1, 2 and 3 with prompts longer than the sliding window (prefilled whole
and in chunks, decoded across it, and again over their cached prefixes), with two-batch
overlap off and on; the compiled path; a served chat in each family's template."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import slow
from test_hf_parity import check_logits

from braid import LLM, SamplingParams

FAMILIES = ("mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma3", "phi3")
WINDOW = 48  # the tiny presets' sliding window, where the family has one
# 40 prompt tokens + NEW_TOKENS cross the window while decoding; 60 and 130 in prefill. With a
# step budget of STEP_TOKENS the first step holds the 40 and 60 whole and 12 tokens of the 130,
# the next the 130's other 118 after its cached 12.
PROMPT_LENGTHS = (40, 60, 130)
STEP_TOKENS = 112
NEW_TOKENS = 16


@pytest.fixture(scope="session")
def family(tmp_path_factory, tokenizer):
    """`family(arch)` -> (folder, transformers model) of the arch's tiny preset, made once."""
    from transformers import AutoModelForCausalLM

    from braid.random_model import make_random_model

    @functools.cache
    def make(arch: str):
        folder = tmp_path_factory.mktemp(arch) / "model"
        make_random_model(arch, "tiny", str(folder), tokenizer=tokenizer)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        return str(folder), model

    return make


@pytest.fixture(scope="session")
def family_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(1000, 40000, (n,), generator=generator).tolist()
            for n in PROMPT_LENGTHS]


@functools.cache
def _reference(model, prompts: tuple[tuple[int, ...], ...]):
    """transformers' prompt logits and greedy tokens (argmax of full forward passes: its
    `generate` would hold back the EOS some presets reach)."""
    logits, greedy = [], []
    with torch.inference_mode():
        for prompt in prompts:
            logits.append(model(torch.tensor([prompt])).logits[0].float())
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            greedy.append(ids[len(prompt):])
    return logits, greedy


def reference(model, prompts: list[list[int]]):
    return _reference(model, tuple(map(tuple, prompts)))


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


# The default suite runs the two families whose layers differ most from Llama's (Gemma 3's norms
# and windows, Qwen3-MoE's experts and QK norms); `-m ""` runs every family at every tp and both
# collective backends of the MoE families.
DEFAULT_CASES = {("qwen3_moe", 2, "shm"), ("gemma3", 2, "shm")}
CASES = sorted({*DEFAULT_CASES, *((arch, tp, "shm") for arch in FAMILIES for tp in (1, 2, 3)),
                *((arch, 2, "torch") for arch in ("qwen3_moe", "mixtral", "gemma3"))})


@pytest.mark.parametrize("arch,tp,comm", [
    case if case in DEFAULT_CASES else slow(*case) for case in CASES])
def test_families_match_transformers(arch, tp, comm, family, family_prompts):
    """Prompt logits, then greedy tokens fresh and over the cached prefixes; at tp > 1 again
    with every step split in two overlapped micro-batches (around the experts' all-reduce in
    the MoE families, around Gemma's sandwich-norm stages), which must give the same."""
    folder, model = family(arch)
    ref_logits, ref_greedy = reference(model, family_prompts)
    with LLM(folder, tp=tp, dtype="fp32", comm=comm,
             max_num_batched_tokens=STEP_TOKENS) as llm:
        for overlap in ("off", "on") if tp > 1 else ("off",):
            llm.switch(overlap=overlap)
            check_logits(llm.prompt_logits(family_prompts), ref_logits)
            fresh = [out.token_ids for out in llm.generate(family_prompts, GREEDY)]
            # Again: the prompts' full blocks now come from the prefix cache.
            cached = [out.token_ids for out in llm.generate(family_prompts, GREEDY)]
            assert fresh == ref_greedy, f"overlap {overlap}"
            assert cached == ref_greedy, f"overlap {overlap}"
        paths = dict(llm.core.steps_by_path)
    if tp > 1:
        assert paths.get("eager+overlap", 0) >= NEW_TOKENS, paths


def test_the_window_changes_these_prompts(family, family_prompts):
    """Guards the test above: without its window, a sliding-window family would give other
    logits for the prompts longer than the window, so matching transformers tests it."""
    from transformers import AutoModelForCausalLM

    folder, model = family("mistral")
    ref_logits, _ = reference(model, family_prompts)
    unwindowed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                      sliding_window=None).eval()
    with torch.inference_mode():
        logits = unwindowed(torch.tensor([family_prompts[-1]])).logits[0]
    assert (logits[:WINDOW] - ref_logits[-1][:WINDOW]).abs().max() < 1e-4
    assert (logits[WINDOW:] - ref_logits[-1][WINDOW:]).abs().max() > 0.1


@pytest.mark.slow  # compiling at tp 2 takes minutes here
@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "phi3", "mistral", "qwen3"])
def test_compiled_steps_match_transformers(arch, family, family_prompts):
    """Decode steps through the compiled graph at tp 2: windowed layers read the traced
    kernel under a sliding key mask, Gemma's norms and block order in the graph. (Overlap
    off, so that no step of several rows runs compiled pieces instead.)"""
    folder, model = family(arch)
    _, ref_greedy = reference(model, family_prompts)
    with LLM(folder, tp=2, dtype="fp32", compile="on", overlap="off") as llm:
        outputs = llm.generate(family_prompts, GREEDY)
        paths = dict(llm.core.steps_by_path)
    assert [out.token_ids for out in outputs] == ref_greedy
    assert paths.get("graph", 0) >= NEW_TOKENS - 1, paths


@pytest.mark.parametrize("arch", [slow(a) for a in FAMILIES])
def test_a_served_chat_uses_the_family_template(arch, family, tokenizer, tmp_path):
    """`braid serve --model <tiny folder> --tp 2`: a chat completion whose prompt is the
    folder's own template (the family's format), not the embedded tokenizer's ChatML."""
    import openai
    from server_utils import braid_server

    from braid.loader.tokenizer import apply_chat_template, load_tokenizer

    folder, _ = family(arch)
    question = "Name a colour."
    expected = apply_chat_template(load_tokenizer(folder, use_cache=False), question)
    assert expected != apply_chat_template(tokenizer, question)
    with braid_server("--model", folder, "--tp", "2", log_dir=tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none",
                               max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": question}])
    assert reply.usage.prompt_tokens == len(expected)
    assert reply.usage.completion_tokens >= 1
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_phi3_longrope_matches_transformers_within_the_original_context(family, tmp_path):
    """LongRoPE (Phi-3.5, Phi-3-128k): the short factors and the attention factor of a
    stretched context, at positions below the original context (beyond it transformers
    switches every position of a pass to the long factors; braid switches per position)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path / "phi3-longrope"
    shutil.copytree(family("phi3")[0], folder)
    config = json.loads((folder / "config.json").read_text())
    half = config["hidden_size"] // config["num_attention_heads"] // 2
    config.update(original_max_position_embeddings=64, max_position_embeddings=256,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                   "short_factor": [1.0 + i / half for i in range(half)],
                                   "long_factor": [2.0 + i for i in range(half)]})
    (folder / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = [list(range(1000, 1040)), list(range(5000, 5030))]
    ref_logits, ref_greedy = reference(model, prompts)
    with LLM(str(folder), dtype="fp32") as llm:
        check_logits(llm.prompt_logits(prompts), ref_logits)
        assert [out.token_ids for out in llm.generate(prompts, GREEDY)] == ref_greedy
