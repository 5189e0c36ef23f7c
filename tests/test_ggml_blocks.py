"""Weights kept in a GGUF file's quantized blocks (`braid.layers.ggml_weight`,
`csrc/ggml_blocks.cpp`, `csrc/ggml_int8.cpp`): every format decodes exactly as the `gguf`
package dequantizes, GEMMs over the blocks equal GEMMs over the dequantized weight at every row
count (in bf16 with the input rounded to int8 per block of columns where the int8 kernels
serve, as llama.cpp computes), a row's result does not depend on the rows beside it, a fused
parameter keeps each of its tensors' formats, a split that cuts a block is refused by name, and
the engine generates from the blocks what transformers generates from the dequantized weights
(fp32), with overlap on and at tp 3, holding no more than the file's bytes; in bf16, what
llama.cpp's arithmetic gives."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from conftest import slow
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from test_hf_parity import check_logits

from braid import LLM, SamplingParams, native
from braid.distributed.comm import SkipCommunicator
from braid.layers import decode_kernel
from braid.layers.ggml_weight import (
    ALL_ROWS,
    FEW_ROWS,
    X16,
    GGMLWeight,
    interleave_rows,
    keep_blocks,
    rounds_inputs,
)
from braid.layers.linear import QKVParallelLinear, RowParallelLinear
from braid.layers.partition import partition_heads
from braid.loader.weights import LazyWeight

pytestmark = pytest.mark.skipif(not native.load(), reason="braid's C++ operators are not built")

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Where each format keeps its fp16 scale (and minimum) in a block
_HALVES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
           Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(kind: Q, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """`rows` rows of random blocks of `kind` (uint8 `[rows, bytes]`), their fp16 scales and
    minimums small and finite: any bytes are a valid block."""
    from gguf import GGML_QUANT_SIZES

    elements, nbytes = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, columns // elements, nbytes), dtype=np.uint8)
    for offset in _HALVES[kind]:
        halves = rng.uniform(1e-3, 2e-2, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def dequantized(blocks: np.ndarray, kind: Q, columns: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, kind).reshape(-1, columns).astype(np.float32))


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_blocks_decode_as_the_gguf_package_dequantizes(kind):
    blocks = random_blocks(kind, 9, 512)
    expected = dequantized(blocks, kind, 512)
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.ops.braid.ggml_dequantize(torch.from_numpy(blocks), int(kind), 512, dtype)
        assert torch.equal(got, expected.to(dtype)), dtype


def int8_input_product(x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """`x @ weight.T` in float64 with x first rounded as the int8 kernels round it: per `block`
    columns, to the nearest even multiple of the block's largest |x| / 127."""
    blocks = x.float().view(x.shape[0], -1, block)
    largest = blocks.abs().amax(-1, keepdim=True)
    quants = torch.round(blocks * (127 / largest))
    return ((quants * (largest / 127)).double()).view(x.shape) @ weight.double().T


# Inputs sharing one int8 scale, as llama.cpp rounds them for each format
INPUT_BLOCK = {Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256, Q.Q8_0: 32}


def int8_rows(round_inputs: bool) -> int:
    """`ggml_linear`'s rows rounded to int8 with and without `--block-inputs int8`."""
    return FEW_ROWS if round_inputs else 0


def int8_inputs(kind: Q, x: torch.Tensor, round_inputs: bool = True) -> bool:
    return round_inputs and x.shape[0] <= FEW_ROWS and rounds_inputs(int(kind), x.dtype,
                                                                     x.shape[1])


def reference_product(x: torch.Tensor, weight: torch.Tensor, kind: Q,
                      round_inputs: bool = True) -> torch.Tensor:
    """What `ggml_linear` computes over blocks of `kind` dequantizing to `weight`, in float64."""
    if int8_inputs(kind, x, round_inputs):
        return int8_input_product(x, weight, INPUT_BLOCK[kind])
    return x.double() @ weight.double().T


@pytest.mark.parametrize("round_inputs", [True, False], ids=["int8-inputs", "float-inputs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_a_product_over_blocks_is_the_product_with_the_dequantized_weight(kind, dtype,
                                                                          round_inputs):
    """1-9 rows through the few-row kernel (tiles of four weight rows, then one at a time:
    2101 rows) or the int8 one (`round_inputs`, where it serves), more through ATen's GEMM
    over decoded chunks (2101 rows of 512 make two)."""
    rows, columns = 2101, 512
    blocks = random_blocks(kind, rows, columns, seed=1)
    weight = dequantized(blocks, kind, columns).to(dtype).double()
    gen = torch.Generator().manual_seed(0)
    for m in (1, 3, 5, 9, FEW_ROWS + 7):
        x = torch.randn(m, columns, generator=gen).to(dtype)
        y = torch.ops.braid.ggml_linear(x, torch.from_numpy(blocks), int(kind), FEW_ROWS,
                                        int8_rows(round_inputs))
        assert y.dtype == dtype and y.shape == (m, rows)
        expected = reference_product(x, weight, kind, round_inputs)
        # Rounding bounds relative to the sum of |products|: fp32 sums in another order, bf16
        # outputs rounded to 8 bits
        bound = (1e-5 if dtype == torch.float32 else 2 ** -8) * (x.double().abs() @ weight.abs().T)
        assert ((y.double() - expected).abs() <= bound).all(), m
        if int8_inputs(kind, x, round_inputs):  # and from the exact product: half a step at most
            block = INPUT_BLOCK[kind]
            steps = x.double().view(m, -1, block).abs().amax(-1) / 127
            rounding = (steps / 2).repeat_interleave(block, dim=1) @ weight.abs().T
            exact = x.double() @ weight.T
            assert ((y.double() - exact).abs() <= rounding + bound).all(), m


@pytest.mark.parametrize("round_inputs", [True, False], ids=["int8-inputs", "float-inputs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_K],
                         ids=lambda k: k.name)
def test_a_few_rows_over_blocks_do_not_depend_on_the_row_count(kind, dtype, round_inputs):
    """Up to FEW_ROWS rows a row's bits do not depend on the rows beside it, so a step's row
    count does not change a sequence's tokens. The int8 kernels (Q4_K, Q6_K, Q8_0: bf16 with
    VNNI, fp32 on AVX2) give each row the bits it has alone; the decoded paths (in registers up
    to four rows, in tiles beyond; Q5_K by the scalar decoder) the few-row kernel's bits over
    the dequantized weight, so the file's format does not change tokens either. Without
    AVX-512, the AVX2 kernels (fp32, int8 or decoded) give each row the bits it has alone."""
    few_rows_kernel = decode_kernel.few_rows_fits(torch.empty(1, 512, dtype=dtype))
    avx2 = not few_rows_kernel and decode_kernel.block_kernels_serve(dtype)
    if not (few_rows_kernel or avx2):
        pytest.skip("no few-row kernel over these blocks on this CPU")
    rows, columns = 70, 512
    blocks = torch.from_numpy(random_blocks(kind, rows, columns, seed=2))
    weight = dequantized(blocks.numpy(), kind, columns).to(dtype)
    x = torch.randn(FEW_ROWS, columns, generator=torch.Generator().manual_seed(0)).to(dtype)
    for m in (1, 2, 3, 4, 5, 8, 9, FEW_ROWS):
        y = torch.ops.braid.ggml_linear(x[-m:], blocks, int(kind), FEW_ROWS,
                                        int8_rows(round_inputs))
        if avx2 or int8_inputs(kind, x[-m:], round_inputs):
            alone = [torch.ops.braid.ggml_linear(x[i:i + 1], blocks, int(kind), FEW_ROWS,
                                                 int8_rows(round_inputs))
                     for i in range(FEW_ROWS - m, FEW_ROWS)]
            assert torch.equal(y, torch.cat(alone)), m
        else:
            assert torch.equal(y, torch.ops.braid.few_rows_linear(x[-m:], weight)), m


@pytest.mark.skipif(not native.load() or not rounds_inputs(X16 + int(Q.Q8_0), torch.bfloat16, 512),
                    reason="no interleaved kernel on this CPU")
@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda k: k.name)
def test_interleaved_blocks_decode_and_multiply_as_the_blocks(kind):
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K interleaved 16 rows to a group
    (`interleave_rows`, made at load where the int8 kernel serves them) decode and look rows up
    as the blocks they came from; up to the rows that round their inputs (FEW_ROWS, or any number:
    CPUs without AMX) their products are those of the int8-rounded inputs (each row's bits those it
    has alone, across the kernel's tiles of 64 rows too), within the bounds of the tests above,
    for bf16 and fp32 inputs, and beyond them the blocks' own bits (the groups decoded back into
    blocks)."""
    rows, columns = 96, 512
    interleaved = X16 + int(kind)
    if not rounds_inputs(interleaved, torch.bfloat16, columns):
        pytest.skip(f"no interleaved {kind.name} kernel on this CPU (Q5_0 and Q5_1 need VBMI)")
    blocks = random_blocks(kind, rows, columns, seed=3)
    weight = dequantized(blocks, kind, columns)
    groups = interleave_rows(torch.from_numpy(blocks), int(kind))
    assert groups.shape == (rows // 16, blocks.shape[1] * 16)
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.ops.braid.ggml_dequantize(groups, interleaved, columns, dtype)
        assert torch.equal(got, weight.to(dtype)), dtype
    ids = torch.tensor([[0, 17, 95], [5, 5, 64]])
    looked_up = GGMLWeight(columns, [interleaved], [groups]).lookup(ids, torch.bfloat16)
    assert torch.equal(looked_up, weight.bfloat16()[ids])
    x = torch.randn(80, columns, generator=torch.Generator().manual_seed(0)).bfloat16()
    for dtype, m, rounded in itertools.product((torch.bfloat16, torch.float32),
                                               (1, 5, 9, FEW_ROWS, FEW_ROWS + 7, 80),
                                               (FEW_ROWS, ALL_ROWS)):
        inputs = x[:m].to(dtype)
        y = torch.ops.braid.ggml_linear(inputs, groups, interleaved, FEW_ROWS, rounded)
        assert y.dtype == dtype
        int8 = m <= rounded
        expected = (int8_input_product(x[:m], weight, INPUT_BLOCK.get(kind, 32)) if int8
                    else x[:m].double() @ weight.double().T)
        bound = 2 ** -8 * (x[:m].double().abs() @ weight.double().abs().T)
        assert ((y.double() - expected).abs() <= bound).all(), (dtype, m, rounded)
        if int8:
            alone = [torch.ops.braid.ggml_linear(inputs[i:i + 1], groups, interleaved, FEW_ROWS,
                                                 rounded) for i in range(m)]
            assert torch.equal(y, torch.cat(alone)), (m, rounded)
        else:
            assert torch.equal(y, torch.ops.braid.ggml_linear(inputs, torch.from_numpy(blocks),
                                                              int(kind), FEW_ROWS, rounded))


def test_blocks_of_another_width_are_refused():
    blocks = torch.from_numpy(random_blocks(Q.Q4_K, 4, 512))
    with pytest.raises(RuntimeError, match="512 columns in blocks of 256 take 288 bytes"):
        torch.ops.braid.ggml_linear(torch.zeros(1, 512), blocks[:, :100].contiguous(),
                                    int(Q.Q4_K), FEW_ROWS, FEW_ROWS)
    with pytest.raises(RuntimeError, match="GGML type 1 has no block decoder"):
        torch.ops.braid.ggml_linear(torch.zeros(1, 512), blocks, 1, FEW_ROWS, FEW_ROWS)


class BlockTensor(LazyWeight):
    """A checkpoint tensor in quantized blocks, as a GGUF file's reads."""

    def __init__(self, kind: Q, blocks: np.ndarray, columns: int) -> None:
        self.ggml_type, self.blocks = int(kind), torch.from_numpy(blocks)
        self.shape = (blocks.shape[0], columns)

    def block_rows(self, start: int, length: int) -> torch.Tensor:
        return self.blocks[start:start + length]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        whole = dequantized(self.blocks.numpy(), Q(self.ggml_type), self.shape[1])
        return whole.narrow(dim, start, length)


def test_a_fused_parameter_keeps_each_tensors_format():
    """Q4_K_M's attention: Q and K in Q4_K, V in Q6_K. The fused QKV weight keeps two runs of
    blocks (Q and K merged), its dense parameter holds no memory, and its product is the one
    over the three dequantized tensors."""
    hidden, head_dim = 256, 32
    layer = QKVParallelLinear(hidden, head_dim, partition_heads(4, 2, 1)[0], SkipCommunicator(0, 1))
    parts = {"q": BlockTensor(Q.Q4_K, random_blocks(Q.Q4_K, 128, hidden, 1), hidden),
             "k": BlockTensor(Q.Q4_K, random_blocks(Q.Q4_K, 64, hidden, 2), hidden),
             "v": BlockTensor(Q.Q6_K, random_blocks(Q.Q6_K, 64, hidden, 3), hidden)}
    for shard, tensor in parts.items():
        layer.weight.weight_loader(layer.weight, tensor, shard)
    assert keep_blocks(layer) == sum(t.blocks.numel() for t in parts.values())
    assert layer.ggml.types == [Q.Q4_K, Q.Q6_K]
    assert layer.weight.untyped_storage().nbytes() <= 4  # the dense weight is gone
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0))
    dense = [t.narrow(0, 0, t.shape[0]) for t in parts.values()]
    expected = torch.cat([reference_product(x, w, Q(t.ggml_type))
                          for w, t in zip(dense, parts.values())], dim=1)
    bound = 1e-5 * (x.double().abs() @ torch.cat(dense).double().abs().T)  # fp32 sums' rounding
    assert ((layer(x).double() - expected).abs() <= bound).all()


def test_a_row_parallel_split_that_cuts_a_block_names_the_tp():
    layer = RowParallelLinear(768, 8, SkipCommunicator(0, 2))  # 384 columns: 1.5 blocks
    tensor = BlockTensor(Q.Q4_K, random_blocks(Q.Q4_K, 8, 768), 768)
    with pytest.raises(ValueError, match=r"tp 2: columns \[0, 384\) cut the Q4_K blocks"):
        layer.weight.weight_loader(layer.weight, tensor, None)


@pytest.mark.parametrize("tp,overlap", [(2, "on"), slow(3, "off")])
def test_the_blocks_generate_what_transformers_does_from_the_dequantized_weights(
        tp, overlap, model_path, prompt_ids, hf_reference):
    """The embedded Q4_1 file (its embedding in Q8_0) in fp32, with the decoded products
    (`--block-inputs float`; on AVX2 CPUs int8 inputs are the default): the ranks hold the
    file's bytes (each its share), and logits and greedy tokens are transformers' on the
    dequantized weights (tp 1 and 2 without overlap: test_hf_parity)."""
    ref_logits, ref_greedy = hf_reference
    with LLM(model_path, tp=tp, dtype="fp32", overlap=overlap, block_inputs="float") as llm:
        readies = llm.core.executor.readies
        check_logits(llm.prompt_logits(prompt_ids), ref_logits)
        params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
        outputs = llm.generate(prompt_ids, params)
    assert all("GGUF blocks kept" in r.kernels for r in readies)
    weights = sum(r.weight_bytes for r in readies)
    assert weights <= 1.05 * os.path.getsize(model_path), weights
    for i, (out, ref) in enumerate(zip(outputs, ref_greedy)):
        assert out.token_ids == ref, f"prompt {i}: greedy tokens differ from transformers"


# The most a greedy token's logit may fall short of the best one under the exact fp32 model:
# bf16 and the int8 inputs' rounding moved it by at most 0.23 on an AVX512-VNNI host (bf16
# alone: 0.05); a wrong product moves it by whole units
LOGIT_MARGIN = 0.5


def int8_dtype() -> str | None:
    """The dtype whose few-row GEMMs over the embedded file's Q8_0 LM head round their inputs
    to int8 on this CPU: bf16 with AVX512-VNNI (and the few-row kernel's AVX512-BF16), fp32 on
    AVX2-only CPUs; None elsewhere."""
    if not native.load():
        return None
    if (rounds_inputs(int(Q.Q8_0), torch.bfloat16, 576)
            and decode_kernel.few_rows_serve(torch.bfloat16)):
        return "bf16"
    return "fp32" if rounds_inputs(int(Q.Q8_0), torch.float32, 576) else None


@pytest.mark.skipif(int8_dtype() is None, reason="no int8 kernel over blocks on this CPU")
@pytest.mark.parametrize("tp,overlap", [(2, "on"), slow(1, "off"), slow(3, "on")])
def test_tokens_through_int8_inputs_are_the_exact_models_choices(
        tp, overlap, model_path, prompt_ids, hf_model):
    """The embedded file's LM head (its Q8_0 embedding, tied) rounds the inputs of one
    sequence's decode steps to int8 as llama.cpp does (`int8_dtype`). Fed the same tokens,
    transformers' fp32 model on the dequantized weights ranks each greedy token within
    LOGIT_MARGIN of its best."""
    params = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    with LLM(model_path, tp=tp, dtype=int8_dtype(), overlap=overlap) as llm:
        assert all("block inputs int8" in r.kernels for r in llm.core.executor.readies)
        outputs = [llm.generate([ids], params)[0] for ids in prompt_ids]  # one row a step
    check_shortfalls(hf_model, prompt_ids, outputs)


def check_shortfalls(hf_model, prompt_ids: list[list[int]], outputs) -> None:
    """Fed each prompt and its generated tokens, `hf_model` ranks every generated token within
    LOGIT_MARGIN of its best, and the tokens fall short of it by a tenth of that on average."""
    shortfalls = []
    with torch.inference_mode():
        for i, (ids, out) in enumerate(zip(prompt_ids, outputs)):
            logits = hf_model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1]
            chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
            shortfalls.append(logits.max(-1).values - chosen)
            shortfall = shortfalls[-1].max().item()
            assert shortfall <= LOGIT_MARGIN, f"prompt {i}: a token {shortfall:.2f} below the best"
    mean = torch.cat(shortfalls).mean().item()
    assert mean <= LOGIT_MARGIN / 10, f"the tokens fall {mean:.3f} below the best on average"
