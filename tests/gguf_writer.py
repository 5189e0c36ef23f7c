"""A Hugging Face safetensors folder written as a GGUF file the way llama.cpp's converter
(`convert_hf_to_gguf.py`, now `conversion/*.py`) writes it, for tests of braid's GGUF reading.

It is written independently of braid's reader (`braid.loader.gguf_families` and the families'
`GGUFMapping`s), from the converter's rules: tensor names through `gguf.TensorNameMap.get_name`
(the converter's own direction, Hugging Face -> GGUF), the rotary permutation of Q and K for the
`llama` architecture only (LlamaModel.permute), `+1` on Gemma 3's norms (Gemma3Model.norm_shift),
experts stacked into one 3-D tensor per projection (`torch.stack(..., dim=0)` in LlamaModel and
Qwen2MoeModel), Phi-3's fused `qkv_proj`/`gate_up_proj` kept as `attn_qkv`/`ffn_up` and its
LongRoPE factors as tensors. The tokenizer is the embedded SmolLM2 GGUF's (the tiny test
folders use SmolLM2's vocabulary).
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from safetensors.torch import load_file

from braid.config import default_model_path

# The GGUF architecture each Hugging Face class is converted to (Mixtral is `llama` with
# experts, as in conversion/llama.py).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}


def write_gguf(folder: str | Path, out: str | Path,
               qtype: GGMLQuantizationType | None = None,
               renamed_tokens: dict[int, str] | None = None) -> Path:
    """Write the model in `folder` as the GGUF file `out`: F32 tensors, or `qtype` for the
    matrices whose rows hold whole quantization blocks (norms and biases stay F32, as
    llama.cpp keeps them). `renamed_tokens` gives some of the vocabulary's tokens other
    texts (id -> text)."""
    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    arch = ARCHITECTURES[cfg["architectures"][0]]
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    writer = GGUFWriter(str(out), arch)
    _write_metadata(writer, cfg, arch)
    _copy_tokenizer(writer, cfg, renamed_tokens or {})
    names = gguf.TensorNameMap(model_arch, cfg["num_hidden_layers"])
    for name, tensor in _converted(cfg, arch, tensors):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        _add_tensor(writer, gguf_name, tensor.float().numpy(), qtype)
    rope = _rope(cfg)
    for key, kind in (("long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
                      ("short_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)):
        if rope.get(key):  # Phi3MiniModel.generate_extra_tensors
            writer.add_tensor(gguf.TENSOR_NAMES[kind] + ".weight",
                              np.asarray(rope[key], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tensor(writer: GGUFWriter, name: str, array: np.ndarray,
                qtype: GGMLQuantizationType | None) -> None:
    block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
    if qtype is not None and array.ndim >= 2 and array.shape[-1] % block == 0:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(name, np.ascontiguousarray(array))


def permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K permutation (LlamaModel.permute): per head, the two rotary halves
    interleaved."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _converted(cfg: dict, arch: str, tensors: dict[str, torch.Tensor]):
    """(Hugging Face name, tensor) as the converter hands them to the name map."""
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in sorted(tensors.items()):
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = permute(tensor, cfg["num_attention_heads"])
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = permute(tensor, cfg["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor + 1
        head, sep, tail = name.partition(".experts.")
        if sep:
            index, _, leaf = tail.partition(".")
            experts.setdefault(f"{head}.experts.{leaf}", {})[int(index)] = tensor
            continue
        yield name, tensor
    for name, per_expert in experts.items():
        yield name, torch.stack([per_expert[e] for e in sorted(per_expert)], dim=0)


def _rope(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or {}
    return rope.get("full_attention", rope)


def _write_metadata(writer: GGUFWriter, cfg: dict, arch: str) -> None:
    """The keys TextModel.set_gguf_parameters and the family's converter class write."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = _rope(cfg)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch != "phi3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if not cfg.get("norm_topk_prob", False):
            # the converter writes no key and llama.cpp renormalises; say so when it must not
            writer.add_expert_weights_norm(False)
    if arch == "gemma3":
        _gemma3_metadata(writer, cfg, head_dim)
    if arch == "phi3":
        _phi3_metadata(writer, cfg, head_dim)


def _gemma3_metadata(writer: GGUFWriter, cfg: dict, head_dim: int) -> None:
    """conversion/gemma.py's Gemma3Model, plus the keys llama.cpp reads where this model
    differs from what it assumes for Gemma 3 (layer pattern, local rotary base, scale)."""
    layers = cfg["num_hidden_layers"]
    types = cfg["layer_types"]
    if "sliding_attention" in types:
        writer.add_sliding_window(cfg["sliding_window"])
        if types != ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                     for i in range(layers)]:
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    local = cfg["rope_parameters"]["sliding_attention"]["rope_theta"]
    if local != 10000.0:
        writer.add_rope_freq_base_swa(local)
    assumed = cfg["hidden_size"] // cfg["num_attention_heads"] if layers == 62 else head_dim
    if cfg["query_pre_attn_scalar"] != assumed:
        writer.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])


def _phi3_metadata(writer: GGUFWriter, cfg: dict, head_dim: int) -> None:
    """conversion/phi.py's Phi3MiniModel: the original context, the rotated dimensions, the
    window (0 for none) and, with LongRoPE, the attention factor (the factors are tensors)."""
    rope = _rope(cfg)
    original = cfg.get("original_max_position_embeddings") \
        or rope["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
    writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


@cache
def _tokenizer_fields() -> tuple[tuple[str, object, list[GGUFValueType]], ...]:
    reader = GGUFReader(default_model_path())
    return tuple((key, field.contents(), list(field.types))
                 for key, field in reader.fields.items() if key.startswith("tokenizer."))


def _copy_tokenizer(writer: GGUFWriter, cfg: dict, renamed: dict[int, str]) -> None:
    """The embedded model's tokenizer keys, with the folder's own BOS and EOS ids and the
    `renamed` tokens' texts."""
    own = {gguf.Keys.Tokenizer.BOS_ID: cfg.get("bos_token_id"),
           gguf.Keys.Tokenizer.EOS_ID: cfg.get("eos_token_id")}
    for key, value in own.items():
        if isinstance(value, list):
            value = value[0]
        if value is not None:
            writer.add_uint32(key, value)
    for key, value, types in _tokenizer_fields():
        if own.get(key) is not None:
            continue
        if key == gguf.Keys.Tokenizer.LIST and renamed:
            value = [renamed.get(i, token) for i, token in enumerate(value)]
        sub_type = types[-1] if types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, types[0], sub_type)
