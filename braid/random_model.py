"""`braid make-random-model`: a random-weight Hugging Face checkpoint folder.

Tests and benchmarks need checkpoints of every supported family at chosen shapes without a
download. The folder holds `config.json`, `model.safetensors` with the architecture's usual
weight names (per-expert MoE tensors, as the families ship them) and the embedded model's
tokenizer. Weights are drawn with std 1/sqrt(fan_in), so activations stay of order one and
greedy decoding has clear margins; norms are near one (Gemma's, which scale by 1 + w, near 0).

Each family's presets are in its spec (`RandomModel`, braid.models.spec). DeepSeek and Llama
folders are written from them by the code here. The other families are built with
transformers' own config and model classes and saved by `save_pretrained`, so their configs and
weight names are exactly what transformers writes and reads; their tokenizer gets a chat
template in the family's own format (`CHAT_TEMPLATES`), since the embedded SmolLM2 tokenizer's
own is ChatML.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from braid.config import DTYPES, default_model_path
from braid.errors import UserError
from braid.models.registry import RANDOM_MODELS

# Every family's make-random-model names, and the presets each has.
ARCHS = sorted(RANDOM_MODELS)
# Every family has the common presets; the real shapes are Llama's (and Qwen3's 8b).
COMMON_PRESETS = ["tiny", "bench"]
PRESETS = [*COMMON_PRESETS, "1b", "3b", "8b"]
# The chat template of each family that has one of its own (`RandomModel.chat_template`).
CHAT_TEMPLATES = {name: spec.random.chat_template for name, spec in RANDOM_MODELS.items()
                  if spec.random.chat_template}


def model_config(arch: str, preset: str, vocab_size: int, bos: int | None,
                 eos: int | None) -> dict:
    """The `config.json` contents of a random DeepSeek or Llama model (the other families:
    `transformers_config`): the preset's over the entries every such model has."""
    spec = RANDOM_MODELS[arch]
    common = dict(vocab_size=vocab_size, hidden_act="silu", max_position_embeddings=2048,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=bos, eos_token_id=eos, attention_bias=False, use_cache=True)
    return {"architectures": [spec.name], "model_type": spec.model_type, **common,
            **spec.random.presets[preset]}


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
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", (config["vocab_size"], h)
    for i in range(config.get("num_nextn_predict_layers") or 0):
        yield from _mtp_layer(config, config["num_hidden_layers"] + i)


def _mtp_layer(config: dict, index: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """DeepSeek-V3's multi-token-prediction layer `index`, in the official checkpoint's names:
    its own norms and projection, a MoE decoder layer, and copies of the embedding and the
    head (`make_random_model` makes them the model's own, as in DeepSeek-V3's file)."""
    h, p = config["hidden_size"], f"model.layers.{index}."
    one_layer = {**config, "num_hidden_layers": 1, "first_k_dense_replace": 0,
                 "num_nextn_predict_layers": 0}
    for name, shape in weight_shapes(one_layer):
        if name.startswith("model.layers.0."):
            yield p + name.removeprefix("model.layers.0."), shape
    yield p + "enorm.weight", (h,)
    yield p + "hnorm.weight", (h,)
    yield p + "eh_proj.weight", (h, 2 * h)
    yield p + "embed_tokens.weight", (config["vocab_size"], h)
    yield p + "shared_head.norm.weight", (h,)
    yield p + "shared_head.head.weight", (config["vocab_size"], h)


def _copied_from(name: str) -> str | None:
    """The tensor a checkpoint stores a copy of under `name`: DeepSeek-V3's MTP layers hold the
    model's embedding and head."""
    if name.startswith("model.layers.") and name.endswith("embed_tokens.weight"):
        return "model.embed_tokens.weight"
    if name.endswith("shared_head.head.weight"):
        return "lm_head.weight"
    return None


def _copy_decoder_as_mtp(config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Make a DeepSeek-V3 checkpoint one MoE decoder layer (the preset's second) whose MTP
    layer is a copy of it, in place: embedding rows of unit RMS, `enorm` and `hnorm` of ones,
    `eh_proj` passing the normed embedding through, the final norm as `shared_head.norm`. The
    MTP layer at position p then computes what the model computes at p + 1 for the sequence
    without its first token (rotary attention depends on distances only), so its proposals are
    the model's own next-but-one tokens, less where the first token sways them: a draft with
    a known, high acceptance for tests and figures of `--speculative mtp`."""
    h = config["hidden_size"]
    config.update(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=1)
    embed = tensors["model.embed_tokens.weight"].float()
    embed = (embed / embed.pow(2).mean(-1, keepdim=True).sqrt()).to(tensors[
        "model.embed_tokens.weight"].dtype)
    layer = {name.removeprefix("model.layers.1."): tensor for name, tensor in tensors.items()
             if name.startswith("model.layers.1.")}
    kept = {name: tensors[name] for name in ("model.norm.weight", "lm_head.weight")}
    tensors.clear()
    tensors.update(kept)
    tensors["model.embed_tokens.weight"] = embed
    dtype = embed.dtype
    for name, tensor in layer.items():
        tensors["model.layers.0." + name] = tensor
        tensors["model.layers.1." + name] = tensor.clone()
    p = "model.layers.1."
    tensors[p + "enorm.weight"] = torch.ones(h, dtype=dtype)
    tensors[p + "hnorm.weight"] = torch.ones(h, dtype=dtype)
    tensors[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1).to(dtype)
    tensors[p + "shared_head.norm.weight"] = kept["model.norm.weight"].clone()
    tensors[p + "embed_tokens.weight"] = embed.clone()
    tensors[p + "shared_head.head.weight"] = kept["lm_head.weight"].clone()


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


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator,
                  norm_center: float = 1.0, embed_std: float = 1.0) -> torch.Tensor:
    """Norm weights near `norm_center` (1; 0 for norms that scale by 1 + w), biases and the
    correction bias small, matrices with std 1/sqrt(fan_in), embeddings with `embed_std` (1:
    they feed a norm). Stacked expert tensors [experts, out, in] take one expert's fan-in."""
    if name.endswith("norm.weight"):
        return norm_center + 0.1 * torch.randn(shape, generator=generator)
    if name.endswith((".bias", "e_score_correction_bias")):
        return 0.1 * torch.randn(shape, generator=generator)
    std = embed_std if "embed_tokens" in name else shape[-1] ** -0.5
    return std * torch.randn(shape, generator=generator)


def make_random_model(arch: str, preset: str, out_dir: str, seed: int = 0,
                      dtype: str | None = None, tokenizer=None, mtp_copy: bool = False) -> Path:
    """Write the folder; `dtype` defaults to fp32 for `tiny` (exact tests), bf16 for `bench`.
    `tokenizer`: the embedded model's, if already loaded (loading it takes seconds).
    `mtp_copy` (deepseek_v3): see `_copy_decoder_as_mtp`."""
    if mtp_copy and arch != "deepseek_v3":
        raise UserError(f"--mtp-copy is for --arch deepseek_v3, not {arch}")
    if arch not in ARCHS:
        raise UserError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if preset not in PRESETS:
        raise UserError(f"--preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    if preset not in RANDOM_MODELS[arch].random.presets:
        raise UserError(f"--arch {arch} has no preset {preset!r} (its presets: "
                        f"{', '.join(RANDOM_MODELS[arch].random.presets)})")
    dtype = dtype or ("fp32" if preset == "tiny" else "bf16")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out_dir} exists and is not empty")
    if tokenizer is None:
        from braid.loader.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(default_model_path())
    if RANDOM_MODELS[arch].random.transformers:
        _write_transformers_model(arch, preset, dtype, seed, tokenizer, out)
        return out
    config = model_config(arch, preset, len(tokenizer), tokenizer.bos_token_id,
                          tokenizer.eos_token_id)
    config["torch_dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    generator = torch.Generator().manual_seed(seed)
    shapes = list(weight_shapes(config))
    copies = {name: _copied_from(name) for name, _ in shapes if _copied_from(name)}
    tensors = {name: random_tensor(name, shape, generator).to(DTYPES[dtype]).contiguous()
               for name, shape in shapes if name not in copies}
    for name, source in copies.items():
        tensors[name] = tensors[source].clone()
    if mtp_copy:
        _copy_decoder_as_mtp(config, tensors)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))
    return out


def transformers_config(arch: str, preset: str, tokenizer):
    """The transformers config of a family built with transformers' classes
    (`RandomModel.transformers`), with the embedded tokenizer's vocabulary and special
    tokens."""
    import transformers

    spec = RANDOM_MODELS[arch]
    # A real shape's preset brings its own vocabulary size
    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  rms_norm_eps=1e-6)
    return getattr(transformers, spec.hf_config_class)(**{**common,
                                                          **spec.random.presets[preset]})


def _write_transformers_model(arch: str, preset: str, dtype: str, seed: int, tokenizer,
                              out: Path) -> None:
    """Build the family's transformers model, draw every parameter with `random_tensor` (in
    the model's parameter order, from `seed`), save it and the tokenizer with the family's
    chat template."""
    from transformers import AutoModelForCausalLM

    spec = RANDOM_MODELS[arch].random
    config = transformers_config(arch, preset, tokenizer)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    # Tied embeddings are also the LM head, so they take its std 1/sqrt(hidden) (at std 1 the
    # embedding would dominate the small model's residual stream and every logit row would
    # pick the input token again); so do embeddings the model scales up by sqrt(hidden).
    embed_std = (config.hidden_size ** -0.5
                 if config.tie_word_embeddings or spec.scaled_embedding else 1.0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # A tied embedding is one parameter here: drawn once, saved once.
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, tuple(param.shape), generator, spec.norm_center,
                                      embed_std))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    if arch in CHAT_TEMPLATES:
        _set_chat_template(out, CHAT_TEMPLATES[arch])


def _set_chat_template(folder: Path, template: str) -> None:
    """Set the saved tokenizer's chat template in both places loaders look: the
    `chat_template.jinja` file transformers 5 writes and prefers, and the `chat_template`
    entry of `tokenizer_config.json` older loaders read. The shared tokenizer object is left
    as it is."""
    (folder / "chat_template.jinja").write_text(template)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config, indent=2) + "\n")
