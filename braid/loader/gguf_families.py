"""What llama.cpp's converter (`convert_hf_to_gguf.py`) did to each Hugging Face family it
writes as a GGUF architecture, so that reading undoes it.

Per family: the Hugging Face class braid serves it as, whether Q and K rows were permuted for
llama.cpp's interleaved rotary (the `llama` architecture only; the others rotate NeoX-style and
are stored as Hugging Face stores them), whether the RMSNorm weights were shifted (Gemma 3's
norms compute `x * (1 + w)`, llama.cpp's `x * w`, so the converter stored `w + 1`), and how
transformers names the family's modules. Tensor names come from the `gguf` package's own
`TensorNameMap`; metadata keys from `gguf.Keys`; the config is the `config.json` dict transformers
5 writes for the family (`rope_parameters`, `layer_types`, ...), which `ModelConfig.from_hf_dict`
reads as it reads a folder's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import gguf
from gguf import MODEL_TENSOR, Keys

from braid.errors import UserError


@dataclass(frozen=True)
class Family:
    """How one Hugging Face family sits in a GGUF architecture."""

    gguf_arch: str  # `general.architecture`
    architecture: str  # the Hugging Face class (`architectures[0]`)
    model_type: str
    # Q/K rows interleaved per head for llama.cpp's "normal" rotary (LlamaModel.permute)
    rotary_permuted: bool = False
    # added to every `*norm.weight` by the converter (Gemma's `1 + w` folded in)
    norm_offset: float = 0.0
    # transformers' module holding the feed-forward, and its experts' projection names
    ffn_module: str = "mlp"
    expert_leaf: str = r"\w+_proj"


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", "llama", rotary_permuted=True),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "qwen2"),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": Family("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": Family("gemma3", "Gemma3ForCausalLM", "gemma3_text", norm_offset=1.0),
    "phi3": Family("phi3", "Phi3ForCausalLM", "phi3"),
}
# Mixtral is converted as `llama` with stacked experts; transformers keeps Mixtral's own names
# (`block_sparse_moe`, experts' `w1`/`w2`/`w3`) in its checkpoints.
MIXTRAL = Family("llama", "MixtralForCausalLM", "mixtral", rotary_permuted=True,
                 ffn_module="block_sparse_moe", expert_leaf=r"w[123]")
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

# GGUF tensors that are not weights: Phi-3's LongRoPE factors become the config's.
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

Getter = Callable[..., Any]  # get(key template from gguf.Keys, default=None)


def family_of(arch: str, get: Getter, source: str) -> Family:
    """The family of a GGUF architecture; `UserError` listing the supported ones."""
    family = FAMILIES.get(arch)
    if family is None:
        raise UserError(f"{source}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if arch == "llama" and (get(Keys.LLM.EXPERT_COUNT) or 0) > 0:
        return MIXTRAL
    return family


def _layout(family: Family) -> re.Pattern:
    """transformers' names for a decoder-only family: embeddings, final norm and head; per
    layer `*_layernorm`s, `self_attn.*_proj` with per-head `q_norm`/`k_norm`, and the
    feed-forward's `*_proj`, router `gate` and experts."""
    return re.compile(
        r"model\.(embed_tokens|norm)|lm_head"
        r"|model\.layers\.\d+\.(\w+_layernorm|self_attn\.(\w+_proj|[qk]_norm)"
        rf"|{family.ffn_module}\.(\w+_proj|gate|experts\.{family.expert_leaf}))")


@cache
def tensor_names(family: Family, block_count: int) -> dict[str, str]:
    """GGUF tensor name (without `.weight`/`.bias`) -> Hugging Face module name.

    `gguf.TensorNameMap` lists, for each GGUF tensor, every source name some converted model
    used; the family's is the first (in the package's order) that fits transformers' layout
    for the family (`_layout`). An architecture with an `ffn_up` but no `ffn_gate` stores the
    two gated projections fused in `ffn_up` (Phi-3's `gate_up_proj`). Stacked expert tensors
    map to the experts' module without an index (`mlp.experts.gate_proj`); `expert_name`
    puts one in.
    """
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == family.gguf_arch)
    fused_up = MODEL_TENSOR.FFN_GATE not in gguf.MODEL_TENSORS[arch]
    layout = _layout(family)
    candidates: dict[str, list[tuple[MODEL_TENSOR, str]]] = {}
    for source, (kind, name) in gguf.TensorNameMap(arch, block_count).mapping.items():
        candidates.setdefault(name, []).append((kind, source))
    names = {}
    for name, sources in candidates.items():
        fits = [s for kind, s in sources if layout.fullmatch(s)
                and not (fused_up and kind == MODEL_TENSOR.FFN_UP
                         and not s.endswith(".gate_up_proj"))]
        if fits:
            names[name] = fits[0]
    return names


def expert_name(stacked: str, expert: int) -> str:
    """`model.layers.3.mlp.experts.gate_proj` -> `model.layers.3.mlp.experts.{expert}.gate_proj`."""
    head, _, leaf = stacked.rpartition(".")
    return f"{head}.{expert}.{leaf}"


def _scalar(value: Any, what: str) -> Any:
    if isinstance(value, list):
        raise UserError(f"GGUF {what} per layer is not supported (one value for all layers)")
    return value


def _rope_parameters(get: Getter, head_dim: int) -> dict:
    """`rope_parameters` from the rotary metadata (llama.cpp's scaling types linear and yarn)."""
    rope: dict = {"rope_type": "default", "rope_theta": float(get(Keys.Rope.FREQ_BASE, 10000.0))}
    kind = get(Keys.Rope.SCALING_TYPE) or "none"
    if kind == "linear":
        rope.update(rope_type="linear", factor=float(get(Keys.Rope.SCALING_FACTOR)))
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=float(get(Keys.Rope.SCALING_FACTOR)),
                    original_max_position_embeddings=int(get(Keys.Rope.SCALING_ORIG_CTX_LEN)))
        for key, field in ((Keys.Rope.SCALING_YARN_BETA_FAST, "beta_fast"),
                           (Keys.Rope.SCALING_YARN_BETA_SLOW, "beta_slow")):
            if get(key) is not None:
                rope[field] = float(get(key))
    elif kind != "none":
        raise UserError(f"GGUF rope scaling {kind!r} is not supported (none, linear, yarn)")
    rotated = get(Keys.Rope.DIMENSION_COUNT)
    if rotated is not None and int(rotated) != head_dim:
        rope["partial_rotary_factor"] = int(rotated) / head_dim
    return rope


def config_dict(family: Family, get: Getter, shapes: Mapping[str, tuple[int, ...]],
                values: Callable[[str], list[float]]) -> dict:
    """The Hugging Face `config.json` dict of a GGUF file.

    `get` reads a metadata key (a `gguf.Keys` template), `shapes` holds every tensor's shape
    (PyTorch order) by GGUF name, and `values` reads a small tensor (rope factors).
    """
    if "rope_freqs.weight" in shapes:
        raise UserError("GGUF rotary frequency factors (rope_freqs, Llama 3.1-style scaling) "
                        "are not supported")
    heads = int(_scalar(get(Keys.Attention.HEAD_COUNT), "head_count"))
    hidden = int(get(Keys.LLM.EMBEDDING_LENGTH))
    head_dim = int(get(Keys.Attention.KEY_LENGTH) or hidden // heads)
    value_dim = get(Keys.Attention.VALUE_LENGTH)
    if value_dim is not None and int(value_dim) != head_dim:
        raise UserError(f"GGUF value heads of {value_dim} with key heads of {head_dim} are not "
                        "supported")
    layers = int(get(Keys.LLM.BLOCK_COUNT))
    ffn = _scalar(get(Keys.LLM.FEED_FORWARD_LENGTH), "feed_forward_length")
    experts = int(get(Keys.LLM.EXPERT_COUNT) or 0)
    rope = _rope_parameters(get, head_dim)
    cfg: dict = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": int(get(Keys.LLM.VOCAB_SIZE) or shapes["token_embd.weight"][0]),
        "hidden_size": hidden,
        "intermediate_size": int(ffn if ffn is not None
                                 else get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(get(Keys.Attention.HEAD_COUNT_KV, heads),
                                           "head_count_kv")),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(get(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
        "max_position_embeddings": int(get(Keys.LLM.CONTEXT_LENGTH, 4096)),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": get(Keys.Tokenizer.BOS_ID),
        "eos_token_id": get(Keys.Tokenizer.EOS_ID),
    }
    if "partial_rotary_factor" in rope:  # where transformers 4 configs kept it
        cfg["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if experts:
        cfg.update(num_local_experts=experts,
                   num_experts_per_tok=int(get(Keys.LLM.EXPERT_USED_COUNT)))
    bias = "blk.0.attn_q.bias" in shapes
    if family.gguf_arch == "llama":
        cfg.update(attention_bias=bias, mlp_bias="blk.0.ffn_up.bias" in shapes)
        if family is MIXTRAL:
            cfg["sliding_window"] = None
    elif family.gguf_arch.startswith("qwen"):
        _qwen(cfg, family, get, shapes, bias, layers, experts)
    elif family.gguf_arch == "gemma3":
        _gemma3(cfg, get, layers)
    elif family.gguf_arch == "phi3":
        _phi3(cfg, get, shapes, values)
    return cfg


def _qwen(cfg: dict, family: Family, get: Getter, shapes: Mapping, bias: bool, layers: int,
          experts: int) -> None:
    """Qwen2/3: no sliding window (llama.cpp reads none); Qwen3's optional attention bias;
    Qwen3-MoE's experts, which llama.cpp always renormalises over the chosen ones
    (`build_moe_ffn(..., norm_w=true)` in src/models/qwen3moe.cpp) unless the file says."""
    cfg.update(use_sliding_window=False, sliding_window=None)
    if not experts:  # (transformers' Qwen3-MoE config has neither)
        cfg.update(max_window_layers=layers, layer_types=["full_attention"] * layers)
    if family.gguf_arch != "qwen2":  # Qwen2 always has q/k/v biases and no field for them
        cfg["attention_bias"] = bias
    if experts:
        norm = get(Keys.LLM.EXPERT_WEIGHTS_NORM)
        cfg.update(num_experts=experts,
                   moe_intermediate_size=int(get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
                   norm_topk_prob=True if norm is None else bool(norm),
                   decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(layers)
                                    if f"blk.{i}.ffn_gate_inp.weight" not in shapes])


def _gemma3(cfg: dict, get: Getter, layers: int) -> None:
    """Gemma 3 as llama.cpp runs it (`llama_load_hparams_gemma3` / `case LLM_ARCH_GEMMA3` in
    src/llama-model.cpp): with a sliding window every sixth layer global unless the file gives
    a pattern, local layers at rotary base 10000 unless it gives one, and the softmax scale of
    1/sqrt(head_dim), of 1/sqrt(hidden / heads) for the 62-layer (27B) model, unless it gives
    `attention.scale`."""
    window = get(Keys.Attention.SLIDING_WINDOW)
    pattern = get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if not window:
        sliding = [False] * layers
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        period = 6 if pattern is None else int(pattern)
        # llama_hparams::set_swa_pattern: layer il is local iff il % n < n - 1 (0: all local)
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    scale = get(Keys.Attention.SCALE)
    if scale:
        query_scalar = 1.0 / float(scale) ** 2
    elif layers == 62:
        query_scalar = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        query_scalar = cfg["head_dim"]
    full = cfg["rope_parameters"]
    local = {"rope_type": "default",
             "rope_theta": float(get(Keys.Rope.FREQ_BASE_SWA, 10000.0))}
    del cfg["hidden_act"]
    cfg.update(
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"sliding_attention": local, "full_attention": full},
        query_pre_attn_scalar=query_scalar,
        sliding_window=int(window) if window else None,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        final_logit_softcapping=get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
        attn_logit_softcapping=get(Keys.LLM.ATTN_LOGIT_SOFTCAPPING),
        attention_bias=False,
        use_bidirectional_attention=False,
    )


def _phi3(cfg: dict, get: Getter, shapes: Mapping,
          values: Callable[[str], list[float]]) -> None:
    """Phi-3 (conversion/phi.py, Phi3MiniModel): the original context as rope scaling's, the
    LongRoPE factors as the tensors `rope_factors_long`/`_short`, the window 0 when none."""
    original = get(Keys.Rope.SCALING_ORIG_CTX_LEN)
    original = int(original) if original else cfg["max_position_embeddings"]
    window = get(Keys.Attention.SLIDING_WINDOW)
    cfg.update(original_max_position_embeddings=original,
               sliding_window=int(window) if window else None)
    cfg["rope_parameters"].setdefault("partial_rotary_factor", 1.0)  # transformers' Phi-3 has it
    if ROPE_FACTOR_TENSORS[0] in shapes:
        long_factor, short_factor = (values(name) for name in ROPE_FACTOR_TENSORS)
        cfg["rope_parameters"].update(rope_type="longrope", long_factor=long_factor,
                                      short_factor=short_factor,
                                      original_max_position_embeddings=original)
