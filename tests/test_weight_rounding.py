"""`--quantization int4|int8`: weights rounded at load into Q4_K, Q4_1 and Q8_0 blocks that
llama.cpp's own decoder reads back, and a model computed from them that is transformers' on the
rounded weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import hf_greedy, slow
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize
from test_ggml_blocks import check_shortfalls, int8_dtype
from test_hf_parity import check_logits

from braid import LLM, SamplingParams, native
from braid.layers.partition import partition_heads
from braid.layers.weight_rounding import (
    Q4_1,
    Q4_K,
    Q8_0,
    quantize_q4_1,
    quantize_q4_k,
    quantize_q8_0,
    rounded_blocks,
)

GREEDY_TOKENS = 8


def rows_to_round(columns: int) -> torch.Tensor:
    """Random rows with the cases a quantizer can get wrong: a row of zeros, a sub-block of one
    value, one that is all positive (its minimum clamps to zero in Q4_K), a large outlier."""
    w = torch.randn(16, columns, generator=torch.Generator().manual_seed(0)) * 0.05
    w[1] = 0
    w[2, :32] = 0.01
    w[3] = w[3].abs()
    w[4, 7] = 3.0
    return w


@pytest.mark.parametrize("kind,quantize,theirs", [(Q.Q4_K, quantize_q4_k, Q.Q4_1),
                                                  (Q.Q4_1, quantize_q4_1, Q.Q4_1),
                                                  (Q.Q8_0, quantize_q8_0, Q.Q8_0)],
                         ids=["Q4_K", "Q4_1", "Q8_0"])
def test_blocks_are_read_back_as_rounded_weights(kind, quantize, theirs):
    """llama.cpp's layout: the `gguf` package's decoder reads the weights back as roundings of
    them, Gaussian rows no further from the weights than the `gguf` package's own quantizer
    puts them at the same bits (zeros stay zero, an outlier within a percent), and braid's
    decoder reads the same."""
    w = rows_to_round(512)
    blocks = quantize(w)
    back = torch.from_numpy(dequantize(blocks.numpy(), kind).copy()).view(w.shape)
    theirs = torch.from_numpy(dequantize(gguf_quantize(w.numpy(), theirs), theirs).copy())
    gaussian = [0, *range(5, 16)]
    error, their_error = ((b - w)[gaussian].pow(2).mean(-1).sqrt() for b in (back, theirs))
    assert (error <= 1.05 * their_error).all(), (error, their_error)
    assert (back[1] == 0).all()
    assert back[4, 7] == pytest.approx(3.0, rel=0.01)
    assert ((back[3] - w[3]).abs() <= 0.1 * w[3].abs().max()).all()
    if native.load():
        ours = torch.ops.braid.ggml_dequantize(blocks, int(kind), 512, torch.float32)
        assert torch.equal(ours, back)


def test_the_type_numbers_are_ggmls():
    assert (Q4_1, Q8_0, Q4_K) == (int(Q.Q4_1), int(Q.Q8_0), int(Q.Q4_K))


def test_columns_choose_the_format():
    assert rounded_blocks(torch.zeros(2, 512), 4).types == [int(Q.Q4_K)]
    assert rounded_blocks(torch.zeros(2, 96), 4).types == [int(Q.Q4_1)]
    assert rounded_blocks(torch.zeros(2, 96), 8).types == [int(Q.Q8_0)]
    assert rounded_blocks(torch.zeros(2, 100), 4) is None
    assert rounded_blocks(torch.zeros(2, 100), 8) is None
    # a row-parallel slice that starts inside a block of the whole rows
    assert rounded_blocks(torch.zeros(2, 64), 8, first_column=16, row_length=96) is None


def rounded_reference(hf_model, bits: int):
    """transformers' model with every linear weight rounded as `--quantization int{bits}`
    rounds it (the tied embedding with the head)."""
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                weight = module.weight
                blocks = rounded_blocks(weight, bits)
                kind = Q(blocks.types[0])
                back = dequantize(blocks.blocks[0].numpy(), kind).reshape(weight.shape)
                weight.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    return model


@pytest.mark.skipif(int8_dtype() != "bf16", reason="no bf16 int8 kernel over blocks on this CPU")
def test_int4_through_int8_inputs_is_the_rounded_models_choices(model_path, prompt_ids,
                                                                 hf_model):
    """bf16 with --quantization int4 at tp 2, overlap on, llama.cpp's arithmetic (int8
    inputs): the MLP's down projection in Q4_K, the rest in Q4_1, interleaved for the int8
    kernel (prefill too on CPUs without AMX). Fed the same tokens, transformers' fp32 model
    with the weights rounded alike ranks each greedy token within LOGIT_MARGIN of its best."""
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    with LLM(model_path, tp=2, dtype="bf16", overlap="on", quantization="int4") as llm:
        assert all("block inputs int8" in r.kernels for r in llm.core.executor.readies)
        outputs = llm.generate(prompt_ids, params)
    check_shortfalls(rounded_reference(hf_model, 4), prompt_ids, outputs)


@pytest.fixture(scope="module")
def rounded_references(hf_model, prompt_ids):
    """`bits` -> transformers' logits and greedy tokens with the weights rounded so."""
    references = {}

    def reference(bits: int):
        if bits not in references:
            model = rounded_reference(hf_model, bits)
            with torch.inference_mode():
                logits = [model(torch.tensor([ids])).logits[0].float() for ids in prompt_ids]
                greedy = [hf_greedy(model, ids, GREEDY_TOKENS) for ids in prompt_ids]
            references[bits] = logits, greedy
        return references[bits]
    return reference


# The weight bytes the ranks hold at most, as a share of the fp32 model's: Q4_1 and Q4_K (5
# and 4.5 bits a weight), Q8_0 (8.5), and the few dense weights (norms)
HELD = {4: 0.2, 8: 0.28}


def held_parameters(tp: int) -> float:
    """SmolLM2-135M's parameters as its ranks hold them together: each once, and the query,
    key, value and output rows of the heads that more than one rank holds once more per extra
    rank (`partition_heads`: 9 query and 3 KV heads of 64 over a width of 576, 30 layers)."""
    shards = partition_heads(9, 3, tp)
    extra_q = sum(s.held[1] for s in shards) - 9  # Q and O rows
    extra_kv = sum(s.kv_count for s in shards) - 3  # K and V rows
    return 134.5e6 + 30 * 64 * 576 * 2 * (extra_q + extra_kv)


@pytest.mark.skipif(not native.load(), reason="int4 and int8 run on braid's C++ operators")
# int4 in make test: the GGUF blocks' parity (test_ggml_blocks), on the same kernels
@pytest.mark.parametrize("bits,tp,overlap", [(8, 2, "on"), slow(4, 2, "on"), slow(4, 1, "off"),
                                             slow(4, 3, "on"), slow(8, 3, "off")])
def test_rounded_weights_are_transformers_on_the_rounded_weights(bits, tp, overlap, model_path,
                                                                 prompt_ids,
                                                                 rounded_references):
    """The embedded model in fp32 with --quantization int4 (Q4_1 where a rank's columns are
    576 or a third of it, Q4_K for the MLP's down projection) or int8 (Q8_0): logits and
    greedy tokens are transformers' with the same weights rounded (the exact products,
    `--block-inputs float`, as AVX2 CPUs would round fp32 inputs to int8), and the ranks hold
    about the bits a weight of the blocks."""
    ref_logits, ref_greedy = rounded_references(bits)
    with LLM(model_path, tp=tp, dtype="fp32", overlap=overlap, quantization=f"int{bits}",
             block_inputs="float") as llm:
        readies = llm.core.executor.readies
        check_logits(llm.prompt_logits(prompt_ids), ref_logits)
        params = SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
        outputs = llm.generate(prompt_ids, params)
    assert all(f"weights rounded at load to int{bits}" in r.kernels for r in readies)
    assert sum(r.weight_bytes for r in readies) < HELD[bits] * 4 * held_parameters(tp)
    for i, (out, ref) in enumerate(zip(outputs, ref_greedy)):
        assert out.token_ids == ref, f"prompt {i}: greedy tokens differ from transformers"
