"""Embeddings: a prompt's final hidden states pooled (last token or mean) through the engine
like any prefill, at tp 2, equal to transformers' `last_hidden_state` pooled the same way, also
when the prompt is prefilled in chunks and beside a generating request."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import slow

from braid.engine.request import SamplingParams
from braid.errors import UserError
from braid.frontend.llm import LLM
from braid.random_model import make_random_model

MAX_COSINE_DISTANCE = 1e-4
CHUNK = 32  # --max-num-batched-tokens: the long prompt is prefilled in several steps


def hf_pooled(path: str, prompts: list[list[int]], pooling: str) -> list[np.ndarray]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vector = hidden[-1] if pooling == "last" else hidden.mean(0)
            out.append((vector / vector.norm()).numpy())
    return out


@pytest.mark.parametrize("arch", ["qwen3", slow("llama")])
def test_embeddings_equal_transformers_pooled_hidden_states(tmp_path, tokenizer, prompt_ids,
                                                            arch):
    path = str(make_random_model(arch, "tiny", str(tmp_path / arch), tokenizer=tokenizer))
    prompts = [*prompt_ids[:2], list(range(1000, 1000 + 3 * CHUNK + 5))]
    with LLM(path, tp=2, dtype="fp32", max_num_batched_tokens=CHUNK) as llm:
        # A generating request shares the steps (its rows are sampled, the others pooled)
        generating = llm.add_request(prompt_ids[0], SamplingParams(max_new_tokens=4))
        for pooling in ("last", "mean"):
            vectors = llm.embed(prompts, pooling=pooling)
            for got, expected in zip(vectors, hf_pooled(path, prompts, pooling)):
                assert abs(np.linalg.norm(got) - 1) < 1e-5
                assert 1 - float(np.dot(got, expected)) < MAX_COSINE_DISTANCE
        assert generating and not llm.has_work
        with pytest.raises(UserError, match="pooling"):
            llm.embed(prompts, pooling="max")


@pytest.mark.slow  # the figures' command (docs/client-apis.md), in short form
def test_the_embedding_benchmark_runs(tmp_path, tokenizer):
    path = make_random_model("qwen3", "tiny", str(tmp_path / "qwen3"), tokenizer=tokenizer)
    script = Path(__file__).parents[1] / "scripts" / "bench_embeddings.py"
    run = subprocess.run([sys.executable, str(script), "--model", str(path), "--num-inputs",
                          "16", "--input-len", "16", "--hf-batch", "8"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    distance = float(re.search(r"largest cosine distance between their vectors: (\S+)",
                               run.stdout).group(1))
    assert distance < MAX_COSINE_DISTANCE and "braid tp 2:" in run.stdout
