"""`braid eval-perplexity`: llama-perplexity's chunks and figures, and braid's scores equal to
transformers' on the same weights."""

from __future__ import annotations

import math

import numpy as np
import pytest

from braid.config import EngineConfig
from braid.errors import UserError
from braid.eval.perplexity import Perplexity, make_chunks, score_braid, score_transformers

TEXT = " ".join(f"Question {i}: what is {i} plus {i + 1}? The answer is {2 * i + 1}."
                for i in range(40))


class LetterTokenizer:
    """One token per character, BOS (7) in front, as a tokenizer that adds BOS does."""

    bos_token_id = 7

    def __call__(self, text: str) -> dict:
        return {"input_ids": [7, *map(ord, text)]}


def test_chunks_are_llama_perplexitys():
    """Chunks cut the tokens (BOS included) in `ctx_size` pieces, each starting with BOS; the
    tokens after the first half are scored; fewer than two chunks' tokens are refused."""
    chunks = make_chunks(LetterTokenizer(), "abcdefghij", 4, None)  # 11 tokens: 2 chunks
    assert chunks.prompts == [[7, *map(ord, "abc")], [7, *map(ord, "efg")]]
    assert (chunks.first, chunks.scored_per_chunk) == (2, 1)
    assert make_chunks(LetterTokenizer(), "abcdefghij", 4, 1).prompts == chunks.prompts[:1]
    with pytest.raises(UserError, match="has 11 tokens; a context of 6 needs at least 12"):
        make_chunks(LetterTokenizer(), "abcdefghij", 6, None)


def test_a_tokenizer_without_bos_keeps_each_chunks_first_token(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    chunks = make_chunks(tokenizer, TEXT, 64, None)
    assert chunks.prompts == [ids[i:i + 64] for i in range(0, len(ids) - 63, 64)]


def test_perplexity_and_its_error_are_llama_cpps():
    perplexity = Perplexity()
    perplexity.add([-1.0, -3.0])  # mean NLL 2, variance 1
    assert perplexity.value == pytest.approx(math.exp(2))
    assert perplexity.error == pytest.approx(math.exp(2) * math.sqrt(1 / 1))


def test_braids_scores_are_transformers_on_the_same_weights(model_path, tokenizer, hf_model):
    chunks = make_chunks(tokenizer, TEXT, 64, 3)
    # The products over the dequantized weights, as transformers computes (not llama.cpp's
    # int8 inputs, the default where the CPU has the kernel)
    engine = EngineConfig.create(model=model_path, dtype="fp32", compile="off",
                                 max_total_tokens=1024, block_inputs="float")
    braid, _ = score_braid(chunks, engine)
    reference, _ = score_transformers(chunks, hf_model)
    assert np.array(braid).shape == (3, 31)
    np.testing.assert_allclose(braid, reference, atol=2e-3)
