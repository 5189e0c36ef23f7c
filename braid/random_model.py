"""`braid make-random-model`: a random-weight Hugging Face checkpoint folder.

Tests and benchmarks need checkpoints of every supported family at chosen shapes without a
download. The folder holds `config.json`, `model.safetensors` with the architecture's usual
weight names (per-expert MoE tensors, as the families ship them) and the embedded model's
tokenizer. Weights are drawn with std 1/sqrt(fan_in), so activations stay of order one and
greedy decoding has clear margins; norms are near one (Gemma's, which scale by 1 + w, near 0).

DeepSeek and Llama folders are written from the shape tables here. The other families are
built with transformers' own config and model classes and saved by `save_pretrained`, so
their configs and weight names are exactly what transformers writes and reads; their
tokenizer gets a chat template in the family's own format (`CHAT_TEMPLATES`), since the
embedded SmolLM2 tokenizer's own is ChatML.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from braid.config import DTYPES, default_model_path
from braid.errors import UserError

ARCHS = ["deepseek_v2", "deepseek_v3", "gemma3", "llama", "mistral", "mixtral", "phi3", "qwen2",
         "qwen3", "qwen3_moe"]
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


# SmolLM2's heads at head dim 16 (the decode operator's smallest): 9 query and 3 KV heads split
# unevenly at tp 2 (a KV head's group across ranks) and tp 3; 256 MLP columns split unevenly at
# tp 3. Every tiny preset starts from it.
_TINY = dict(hidden_size=144, intermediate_size=256, num_attention_heads=9, num_key_value_heads=3,
             max_position_embeddings=2048)
_BENCH = dict(max_position_embeddings=8192)
# Sliding window of the tiny presets: shorter than the test prompts plus their generations, so
# windowed layers see a different set of keys than full ones.
_TINY_WINDOW = 48

# The families built with transformers' own classes: (config class, preset -> its arguments).
# Bench presets take the widths of a ~1B model of the family (or of its smallest) at 4 layers,
# with the family's rotary bases.
_FAMILIES: dict[str, tuple[str, dict[str, dict]]] = {
    # Mistral-7B-v0.1's window (v0.2 and later have none); bench: the Llama bench widths.
    "mistral": ("MistralConfig", {
        "tiny": dict(**_TINY, head_dim=16, num_hidden_layers=2, sliding_window=_TINY_WINDOW),
        "bench": dict(**_BENCH, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                      sliding_window=4096, rope_parameters=dict(rope_type="default",
                                                                rope_theta=1e6)),
    }),
    # Q/K/V biases by design. tiny: windowed layers from `max_window_layers` on (transformers
    # derives layer_types [full, sliding, sliding]); bench: Qwen2.5-1.5B, tied embeddings.
    "qwen2": ("Qwen2Config", {
        "tiny": dict(**_TINY, num_hidden_layers=3, use_sliding_window=True,
                     sliding_window=_TINY_WINDOW, max_window_layers=1),
        "bench": dict(**_BENCH, hidden_size=1536, intermediate_size=8960, num_hidden_layers=4,
                      num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                      rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    }),
    # Per-head q/k norms and a head dim that is not hidden / heads (9 x 32 = 288 != 144), tied
    # embeddings, as Qwen3's small models; bench: Qwen3-1.7B.
    "qwen3": ("Qwen3Config", {
        "tiny": dict(**_TINY, head_dim=32, num_hidden_layers=2, tie_word_embeddings=True),
        "bench": dict(**_BENCH, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      tie_word_embeddings=True,
                      rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    }),
    # tiny: 8 experts top-2 with renormalised weights, 52 expert columns (uneven over 3 ranks),
    # the middle layer dense (mlp_only_layers); bench: Qwen3-30B-A3B's widths with 32 experts.
    "qwen3_moe": ("Qwen3MoeConfig", {
        "tiny": dict(**_TINY, head_dim=32, num_hidden_layers=3, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=52,
                     decoder_sparse_step=1, mlp_only_layers=[1]),
        "bench": dict(**_BENCH, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      num_experts=32, num_experts_per_tok=8, norm_topk_prob=True,
                      moe_intermediate_size=768,
                      rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    }),
    # 8 experts top-2 as Mixtral-8x7B; no window, as Mixtral's checkpoints.
    "mixtral": ("MixtralConfig", {
        "tiny": dict(**_TINY, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2),
        "bench": dict(**_BENCH, hidden_size=2048, intermediate_size=4096, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                      num_experts_per_tok=2,
                      rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    }),
    # Local (windowed) and global layers, each kind with its own rotary base; a softmax scale
    # from query_pre_attn_scalar != head_dim. tiny: [local, global, local] (the pattern of 2
    # and the explicit list agree), embeddings untied: tied, the input embedding (scaled up by
    # sqrt(hidden)) stays large in so shallow a residual stream, and the tied head then picks
    # the input token again at most positions. bench: Gemma-3-1B's widths, tied, the last of
    # its 4 layers global.
    "gemma3": ("Gemma3TextConfig", {
        "tiny": dict(**_TINY, head_dim=16, num_hidden_layers=3, sliding_window=_TINY_WINDOW,
                     tie_word_embeddings=False,
                     sliding_window_pattern=2,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                     query_pre_attn_scalar=24,
                     rope_parameters={
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="default", rope_theta=1e6)}),
        "bench": dict(**_BENCH, hidden_size=1152, intermediate_size=6912, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      sliding_window=512, sliding_window_pattern=4,
                      query_pre_attn_scalar=256,
                      rope_parameters={
                          "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                          "full_attention": dict(rope_type="default", rope_theta=1e6)}),
    }),
    # Fused qkv_proj and gate_up_proj tensors; a window on every layer, as Phi-3-mini-4k's
    # 2047; bench: Phi-3-mini's widths (multi-head attention).
    "phi3": ("Phi3Config", {
        "tiny": dict(**_TINY, num_hidden_layers=2, sliding_window=_TINY_WINDOW,
                     original_max_position_embeddings=2048),
        "bench": dict(**_BENCH, hidden_size=3072, intermediate_size=8192, num_hidden_layers=4,
                      num_attention_heads=32, num_key_value_heads=32, sliding_window=2047,
                      original_max_position_embeddings=8192),
    }),
}

# Chat templates in each family's own turn format (written for braid, not copied from the
# models' tokenizers), so `--chat` and the server format prompts as the real model expects.
# Text is emitted by expressions only: transformers renders templates with trim_blocks.
_CHATML_TURNS = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ (message['content'] or '') ~ '<|im_end|>\\n' }}"
    "{%- endfor %}"
)
_QWEN2_TEMPLATE = (
    # Qwen2.5's default system prompt when the conversation brings none.
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}" + _CHATML_TURNS +
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_QWEN3_TEMPLATE = (
    # No default system prompt; `enable_thinking=False` (chat_template_kwargs) opens the answer
    # with an empty thinking block, as Qwen3's template does.
    _CHATML_TURNS +
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
_MISTRAL_TEMPLATE = (
    # [INST] turns after the BOS; a system message goes in front of the first user turn; an
    # answer ends with EOS. The model answers right after [/INST]: no generation prompt.
    "{{- bos_token }}"
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' "
    "else '' %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' ~ (system ~ '\\n\\n' if system and loop.first else '') ~ "
    "(message['content'] or '') ~ ' [/INST]' }}"
    "{%- else %}{{- (message['content'] or '') ~ eos_token }}{%- endif %}"
    "{%- endfor %}"
)
_GEMMA_TEMPLATE = (
    # Gemma has no system role: its text opens the first user turn. The assistant is "model".
    "{{- bos_token }}"
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' "
    "else '' %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{{- '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else message['role']) "
    "~ '\\n' ~ (system ~ '\\n\\n' if system and loop.first else '') ~ "
    "(message['content'] or '') ~ '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
_PHI3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' ~ (message['content'] or '') ~ '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
CHAT_TEMPLATES = {
    "gemma3": _GEMMA_TEMPLATE, "mistral": _MISTRAL_TEMPLATE, "mixtral": _MISTRAL_TEMPLATE,
    "phi3": _PHI3_TEMPLATE, "qwen2": _QWEN2_TEMPLATE, "qwen3": _QWEN3_TEMPLATE,
    "qwen3_moe": _QWEN3_TEMPLATE,
}


def model_config(arch: str, preset: str, vocab_size: int, bos: int | None,
                 eos: int | None) -> dict:
    """The `config.json` contents of a random DeepSeek or Llama model (the other families:
    `transformers_config`)."""
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
        from braid.loader.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(default_model_path())
    if arch in _FAMILIES:
        _write_transformers_model(arch, preset, dtype, seed, tokenizer, out)
        return out
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


def transformers_config(arch: str, preset: str, tokenizer):
    """The transformers config of a family built with transformers' classes (`_FAMILIES`),
    with the embedded tokenizer's vocabulary and special tokens."""
    import transformers

    class_name, presets = _FAMILIES[arch]
    return getattr(transformers, class_name)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6, **presets[preset])


def _write_transformers_model(arch: str, preset: str, dtype: str, seed: int, tokenizer,
                              out: Path) -> None:
    """Build the family's transformers model, draw every parameter with `random_tensor` (in
    the model's parameter order, from `seed`), save it and the tokenizer with the family's
    chat template."""
    from transformers import AutoModelForCausalLM

    config = transformers_config(arch, preset, tokenizer)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    # Gemma's RMSNorms multiply by (1 + w): weights near 0 keep its activations of order one.
    norm_center = 0.0 if arch == "gemma3" else 1.0
    # Tied embeddings are also the LM head, so they take its std 1/sqrt(hidden) (at std 1 the
    # embedding would dominate the small model's residual stream and every logit row would
    # pick the input token again); Gemma's too, since it scales them up by sqrt(hidden).
    embed_std = (config.hidden_size ** -0.5 if config.tie_word_embeddings or arch == "gemma3"
                 else 1.0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # A tied embedding is one parameter here: drawn once, saved once.
        for name, param in model.named_parameters():
            param.copy_(random_tensor(name, tuple(param.shape), generator, norm_center,
                                      embed_std))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
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
