"""AWQ and GPTQ checkpoints: their packed integers read as AutoAWQ and GPTQ pack them, kept as
GGML blocks that llama.cpp's own decoder reads back as the checkpoint's weights, and a model
computed from them that is transformers' on the dequantized weights.

The checkpoints here are written by `pack_awq` and `pack_gptq`, which follow AutoAWQ's
`WQLinear_GEMM.pack` (output columns interleaved 0, 2, 4, 6, 1, 3, 5, 7 within an int32) and
AutoGPTQ's `QuantLinear.pack` (input rows packed down an int32, zeros stored minus one)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, slow
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file
from test_hf_parity import check_logits

from braid import LLM, SamplingParams, native
from braid.layers.decode_kernel import block_kernels_serve
from braid.loader.awq_gptq import (
    AWQ_ORDER,
    Q4_0,
    Q4_1,
    Q8_0,
    IntegerWeight,
    IntegerWeights,
    integer_checkpoint_weights,
)
from braid.loader.weights import TensorWeight

GREEDY_TOKENS = 8
# The projections AutoAWQ and GPTQ quantize in a Llama (the embedding and head stay dense)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_the_type_numbers_are_ggmls():
    assert (Q4_0, Q4_1, Q8_0) == (int(Q.Q4_0), int(Q.Q4_1), int(Q.Q8_0))


def test_one_int32_reads_as_autoawq_and_autogptq_pack_it():
    """0x76543210 holds 0..7, lowest bits first: AutoAWQ puts them in output columns 0, 2, 4,
    6, 1, 3, 5, 7; GPTQ in input rows 0..7."""
    packed = torch.tensor([[0x76543210]], dtype=torch.int32)
    scales = torch.ones(1, 8, dtype=torch.float16)
    awq = IntegerWeight({"qweight": TensorWeight(packed.expand(32, 1).contiguous()),
                         "qzeros": TensorWeight(torch.zeros(1, 1, dtype=torch.int32)),
                         "scales": TensorWeight(scales)}, IntegerWeights("awq", 4), False)
    assert awq.narrow(0, 0, 8)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    gptq = IntegerWeight({"qweight": TensorWeight(packed.expand(4, 8).contiguous()),
                          "qzeros": TensorWeight(torch.zeros(1, 1, dtype=torch.int32)),
                          "scales": TensorWeight(scales)}, IntegerWeights("gptq", 4, 1), False)
    assert gptq.narrow(0, 0, 1)[0, :8].tolist() == list(range(-1, 7))  # zeros stored minus 1


def round_groups(w: torch.Tensor, group: int, bits: int, symmetric: bool):
    """Round-to-nearest integers of `w` per row and group of `group` columns: (q uint8
    [out, in], zeros [out, groups], fp16 scales [out, groups]); symmetric: zero 2^(bits-1)."""
    top = (1 << bits) - 1
    g = w.view(w.shape[0], -1, group)
    if symmetric:
        scales = (g.abs().amax(-1) / (top // 2)).clamp(min=1e-8).half()
        zeros = torch.full_like(scales, top // 2 + 1, dtype=torch.int32)
    else:
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((high - low) / top).clamp(min=1e-8).half()
        zeros = (-low / scales.float()).round().clamp(0, top).int()
    q = (g / scales.float().unsqueeze(-1)).round() + zeros.unsqueeze(-1)
    return q.clamp(0, top).to(torch.uint8).view(w.shape), zeros, scales


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers `[r, c]` packed along the columns, lowest bits first: int32 `[r, c*bits/32]`."""
    v = (values.to(torch.int64) & ((1 << bits) - 1)).view(values.shape[0], -1, 32 // bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    return (v << shifts).sum(-1).to(torch.uint32).view(torch.int32)


def pack_awq(q, zeros, scales):
    """AutoAWQ's gemm layout: qweight `[in, out / 8]`, qzeros `[groups, out / 8]`."""
    def interleave(columns):  # packed position i of each 8 holds column AWQ_ORDER[i]
        return columns.view(columns.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].flatten(1)

    return {"qweight": _pack(interleave(q.t()), 4), "qzeros": _pack(interleave(zeros.t()), 4),
            "scales": scales.t().contiguous()}


def pack_gptq(q, zeros, scales, bits, g_idx):
    """GPTQ's original layout: qweight `[in * bits / 32, out]`, zeros stored minus one."""
    return {"qweight": _pack(q, bits).t().contiguous(), "qzeros": _pack(zeros.t() - 1, bits),
            "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def quantize_weight(w: torch.Tensor, method: str, bits: int, group: int, act_order: bool):
    """(checkpoint tensors, the dequantized weight) of `w` as `method` stores it; act-order
    gives the columns to groups in a shuffled order (GPTQ's `g_idx`)."""
    order = (torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(w.shape[0]))
             if act_order else torch.arange(w.shape[1]))
    q, zeros, scales = round_groups(w[:, order], group, bits, symmetric=method == "gptq")
    minimums = (-(zeros * scales.float())).half().float()  # as Q4_1 holds them
    back = (q.float() * scales.float().repeat_interleave(group, 1)
            + minimums.repeat_interleave(group, 1))
    inverse = torch.argsort(order)
    q, back = q[:, inverse], back[:, inverse]
    if method == "awq":
        return pack_awq(q, zeros, scales), back
    return pack_gptq(q, zeros, scales, bits, inverse // group), back


def integer_weight(w, method, bits, group, act_order=False):
    parts, back = quantize_weight(w, method, bits, group, act_order)
    scheme = IntegerWeights(method, bits, zero_offset=1 if method == "gptq" else 0)
    weight = IntegerWeight({k: TensorWeight(v) for k, v in parts.items()}, scheme, True)
    return weight, back


@pytest.mark.parametrize("method,bits,act_order,kind", [
    ("awq", 4, False, Q4_1), ("gptq", 4, False, Q4_0), ("gptq", 8, False, Q8_0),
    ("gptq", 4, True, None)])
def test_blocks_are_the_checkpoints_weights(method, bits, act_order, kind):
    """llama.cpp's decoder reads the blocks back as the weights braid computes, `q * scale +
    fp16(-zero * scale)`, which are `(q - zero) * scale` where the zero is 8 or 128 (else
    within half an fp16 step of the minimum); act-order groups, which no block holds, stay
    dense."""
    w = torch.randn(16, 576, generator=torch.Generator().manual_seed(1)) * 0.05
    weight, back = integer_weight(w, method, bits, 64, act_order)
    assert weight.ggml_type == kind
    assert torch.equal(weight.narrow(0, 3, 5), back[3:8])
    if kind is None:
        return
    blocks = weight.block_rows(0, 16).numpy()
    theirs = torch.from_numpy(dequantize(blocks, Q(kind)).copy()).view(w.shape)
    assert torch.equal(theirs, back)
    if kind != Q4_1:  # symmetric: (q - zero) * scale exactly
        q, zeros, scales = round_groups(w, 64, bits, symmetric=True)
        exact = (q.float() - zeros.repeat_interleave(64, 1)) * scales.float().repeat_interleave(
            64, 1)
        assert torch.equal(back, exact)
    if native.load():
        ours = torch.ops.braid.ggml_dequantize(weight.block_rows(0, 16), kind, 576,
                                               torch.float32)
        assert torch.equal(ours, theirs)


def test_columns_split_on_blocks_not_groups():
    """A rank's columns may start inside a group of 64 (288 of 576), not inside a block."""
    w = torch.randn(8, 576, generator=torch.Generator().manual_seed(2))
    weight, _ = integer_weight(w, "awq", 4, 64)
    full = weight.block_rows(0, 8)
    assert torch.equal(weight.narrow_blocks(1, 288, 288), full[:, 9 * 20:])
    with pytest.raises(ValueError, match="Q4_1 blocks of 32 columns"):
        weight.narrow_blocks(1, 16, 288)


def test_incomplete_layers_are_named():
    w = torch.randn(8, 64)
    parts, _ = quantize_weight(w, "awq", 4, 32, False)
    named = [("layers.0.q_proj.qweight", TensorWeight(parts["qweight"])),
             ("layers.0.q_proj.scales", TensorWeight(parts["scales"]))]
    with pytest.raises(ValueError, match="layers.0.q_proj: .* AWQ weight has no qzeros"):
        list(integer_checkpoint_weights(named, IntegerWeights("awq", 4), True))


# name: (quantization_config, group size, layers whose groups are in act-order)
CHECKPOINTS = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
             "version": "gemm"}, 64, ()),
    "gptq4-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                         "desc_act": True, "checkpoint_format": "gptq"}, 32, range(1, 30, 2)),
    "gptq8": ({"quant_method": "gptq", "bits": 8, "group_size": 64, "sym": True,
               "desc_act": False, "checkpoint_format": "gptq"}, 64, ()),
}


def write_integer_checkpoint(dense: Path, folder: Path, name: str) -> dict[str, torch.Tensor]:
    """The dense folder's projections quantized as checkpoint `name` says, in `folder`; the
    dequantized weights by name."""
    config, group, act_order = CHECKPOINTS[name]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(dense.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    saved, dequantized = {}, {}
    for key, w in tensors.items():
        prefix, _, last = key.rpartition(".")
        if last != "weight" or prefix.rpartition(".")[2] not in PROJECTIONS:
            saved[key] = w
            continue
        layer = int(key.split(".")[2])
        parts, dequantized[key] = quantize_weight(w.float(), config["quant_method"],
                                                  config["bits"], group, layer in act_order)
        saved.update({f"{prefix}.{part}": t for part, t in parts.items()})
    folder.mkdir()
    save_file(saved, str(folder / "model.safetensors"))
    for file in dense.iterdir():
        if file.suffix != ".safetensors" and not file.name.endswith(".index.json"):
            shutil.copy(file, folder / file.name)
    hf_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf_config, "quantization_config": config}))
    return dequantized


@pytest.fixture(scope="module")
def integer_checkpoints(safetensors_folder, hf_model, prompt_ids, tmp_path_factory):
    """Checkpoint name -> (folder, transformers' logits and greedy tokens on its dequantized
    weights), made on first use."""
    made = {}

    def make(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp("integer") / name
            dequantized = write_integer_checkpoint(Path(safetensors_folder), folder, name)
            model = copy.deepcopy(hf_model)
            with torch.inference_mode():
                for key, weight in model.state_dict().items():
                    if key in dequantized:
                        weight.copy_(dequantized[key])
                logits = [model(torch.tensor([ids])).logits[0].float() for ids in prompt_ids]
                greedy = [hf_greedy(model, ids, GREEDY_TOKENS) for ids in prompt_ids]
            made[name] = str(folder), logits, greedy
        return made[name]

    return make


@pytest.mark.skipif(not native.load(), reason="the blocks run on braid's C++ operators")
@pytest.mark.parametrize("name,tp,overlap", [
    slow("awq", 2, "on"), slow("gptq4-act-order", 1, "off"), slow("awq", 3, "on"),
    slow("gptq8", 3, "on"), slow("gptq4-act-order", 2, "on")])
def test_checkpoint_is_transformers_on_its_dequantized_weights(name, tp, overlap, prompt_ids,
                                                               integer_checkpoints):
    """The embedded model's projections as AWQ (Q4_1 blocks, rows split at 288 columns in the
    middle of a group at tp 2), GPTQ 4 bits (Q4_0; every other layer's groups in act-order,
    dense) and GPTQ 8 bits (Q8_0), fp32: logits and greedy tokens are transformers' with the
    dequantized weights, and the blocks are what the ranks hold."""
    folder, ref_logits, ref_greedy = integer_checkpoints(name)
    with LLM(folder, tp=tp, dtype="fp32", overlap=overlap) as llm:
        readies = llm.core.executor.readies
        check_logits(llm.prompt_logits(prompt_ids), ref_logits)
        params = SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
        outputs = llm.generate(prompt_ids, params)
    for i, (out, ref) in enumerate(zip(outputs, ref_greedy)):
        assert out.token_ids == ref, f"prompt {i}: greedy tokens differ from transformers"
    embedding_bytes = 4 * 49152 * 576
    projection_params = 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536)
    held = sum(r.weight_bytes for r in readies) - embedding_bytes
    if not block_kernels_serve(torch.float32):  # no block kernels here: dequantized at load
        assert held >= 4 * projection_params
    elif name != "gptq4-act-order":  # every projection as blocks: at most bits + 1 a weight
        bits = 8 if name == "gptq8" else 4  # (and 5% for the KV head two ranks of 2 or 3 hold)
        assert held <= 1.05 * projection_params * (bits + 1) / 8
