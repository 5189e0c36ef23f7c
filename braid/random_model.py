"""`braid make-random-model`: a random-weight Hugging Face checkpoint folder.

Tests and benchmarks need DeepSeek (and Llama) checkpoints of chosen shapes without a
download. The folder holds `config.json`, `model.safetensors` with the architecture's usual
weight names (per-expert MoE tensors, as DeepSeek ships them) and the embedded model's
tokenizer. Weights are drawn with std 1/sqrt(fan_in), so activations stay of order one and
greedy decoding has clear margins; norms are near one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from braid.config import DTYPES, UserError, default_model_path

ARCHS = ["deepseek_v2", "deepseek_v3", "llama"]
PRESETS = ["tiny", "bench"]

_DEEPSEEK_SHAPES = {
    # Small and deliberately uneven (5 heads, 52 expert columns) so every TP split is tested.
    "tiny": dict(hidden_size=100, intermediate_size=160, moe_intermediate_size=52,
                 num_hidden_layers=3, num_attention_heads=5, kv_lora_rank=32,
                 qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20, n_routed_experts=8,
                 first_k_dense_replace=1),
    # DeepSeek-V2-Lite-like widths with the bench dimensions.
    "bench": dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                  num_hidden_layers=4, num_attention_heads=16, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  n_routed_experts=16, first_k_dense_replace=1, q_lora_rank=1536,
                  num_experts_per_tok=4, n_shared_experts=1),
}

_ROUTERS = {
    # V2: softmax scores; the tiny model uses group-limited greedy (the greedy path has a
    # unit test of its own) and no q LoRA, like V2-Lite.
    "deepseek_v2": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                        scoring_func="softmax", topk_method="group_limited_greedy", n_group=4,
                        topk_group=2, num_experts_per_tok=2, n_shared_experts=2,
                        norm_topk_prob=False, routed_scaling_factor=1.5, q_lora_rank=None),
    # V3: sigmoid scores, correction bias, groups ranked by their two best experts.
    "deepseek_v3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                        num_experts_per_tok=3, n_shared_experts=1, norm_topk_prob=True,
                        routed_scaling_factor=2.5, q_lora_rank=48, rope_interleave=True),
}

_YARN = {
    "deepseek_v2": dict(type="yarn", factor=4.0, original_max_position_embeddings=512,
                        beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
    # mscale != mscale_all_dim: the cos/sin magnitude correction is not 1 either.
    "deepseek_v3": dict(type="yarn", factor=4.0, original_max_position_embeddings=512,
                        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8),
}

_LLAMA_SHAPES = {
    # SmolLM2's heads (9 query, 3 KV: tp 2 splits a KV head's group) at head dim 16, the
    # smallest the decode operator takes.
    "tiny": dict(hidden_size=144, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=9, num_key_value_heads=3),
    "bench": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=4),
}


def model_config(arch: str, preset: str, vocab_size: int, bos: int | None,
                 eos: int | None) -> dict:
    """The `config.json` contents of a random model."""
    common = dict(vocab_size=vocab_size, hidden_act="silu", max_position_embeddings=2048,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=bos, eos_token_id=eos, attention_bias=False, use_cache=True)
    if arch == "llama":
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", **common,
                    **_LLAMA_SHAPES[preset])
    config = {**common, **_ROUTERS[arch], **_DEEPSEEK_SHAPES[preset]}
    config["num_key_value_heads"] = config["num_attention_heads"]
    config["rope_scaling"] = _YARN[arch]
    return config


def weight_shapes(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor, in the architecture's usual names."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    yield "model.embed_tokens.weight", (config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        if config["model_type"] == "llama":
            yield from _llama_attention(p, config)
            yield from _mlp(p + "mlp.", h, inter)
            continue
        yield from _mla(p + "self_attn.", config)
        if i < config["first_k_dense_replace"]:
            yield from _mlp(p + "mlp.", h, inter)
            continue
        experts, moe_inter = config["n_routed_experts"], config["moe_intermediate_size"]
        yield p + "mlp.gate.weight", (experts, h)
        if config["topk_method"] == "noaux_tc":
            yield p + "mlp.gate.e_score_correction_bias", (experts,)
        for e in range(experts):
            yield from _mlp(f"{p}mlp.experts.{e}.", h, moe_inter)
        if config["n_shared_experts"]:
            yield from _mlp(p + "mlp.shared_experts.", h, moe_inter * config["n_shared_experts"])
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (config["vocab_size"], h)


def _mlp(prefix: str, hidden: int, inter: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield prefix + "gate_proj.weight", (inter, hidden)
    yield prefix + "up_proj.weight", (inter, hidden)
    yield prefix + "down_proj.weight", (hidden, inter)


def _llama_attention(prefix: str, config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, heads, kv = (config["hidden_size"], config["num_attention_heads"],
                    config["num_key_value_heads"])
    d = h // heads
    yield prefix + "self_attn.q_proj.weight", (heads * d, h)
    yield prefix + "self_attn.k_proj.weight", (kv * d, h)
    yield prefix + "self_attn.v_proj.weight", (kv * d, h)
    yield prefix + "self_attn.o_proj.weight", (h, heads * d)


def _mla(prefix: str, config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_lora, q_lora = config["kv_lora_rank"], config["q_lora_rank"]
    if q_lora:
        yield prefix + "q_a_proj.weight", (q_lora, h)
        yield prefix + "q_a_layernorm.weight", (q_lora,)
        yield prefix + "q_b_proj.weight", (heads * (nope + rope), q_lora)
    else:
        yield prefix + "q_proj.weight", (heads * (nope + rope), h)
    yield prefix + "kv_a_proj_with_mqa.weight", (kv_lora + rope, h)
    yield prefix + "kv_a_layernorm.weight", (kv_lora,)
    yield prefix + "kv_b_proj.weight", (heads * (nope + v), kv_lora)
    yield prefix + "o_proj.weight", (h, heads * v)


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norm weights near 1, the correction bias small, matrices with std 1/sqrt(fan_in)
    (embeddings std 1: they feed a norm)."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=generator)
    std = 1.0 if "embed_tokens" in name else shape[1] ** -0.5
    return std * torch.randn(shape, generator=generator)


def make_random_model(arch: str, preset: str, out_dir: str, seed: int = 0,
                      dtype: str | None = None, tokenizer=None) -> Path:
    """Write the folder; `dtype` defaults to fp32 for `tiny` (exact tests), bf16 for `bench`.
    `tokenizer`: the embedded model's, if already loaded (loading it takes seconds)."""
    if arch not in ARCHS:
        raise UserError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if preset not in PRESETS:
        raise UserError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    dtype = dtype or ("fp32" if preset == "tiny" else "bf16")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out_dir} exists and is not empty")
    if tokenizer is None:
        from braid.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(default_model_path())
    config = model_config(arch, preset, len(tokenizer), tokenizer.bos_token_id,
                          tokenizer.eos_token_id)
    config["torch_dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: random_tensor(name, shape, generator).to(DTYPES[dtype]).contiguous()
               for name, shape in weight_shapes(config)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))
    return out
