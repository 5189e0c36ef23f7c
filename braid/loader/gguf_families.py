"""What llama.cpp's converter (`convert_hf_to_gguf.py`) did to a Hugging Face family it writes
as a GGUF architecture, so that reading undoes it: the generic part.

Each family says in its spec (`GGUFMapping`, braid.models.spec) which Hugging Face class serves
its GGUF architecture, whether Q and K rows were permuted for llama.cpp's interleaved rotary,
whether the RMSNorm weights were shifted, how transformers names the family's modules, and the
config fields of its own (a hook). Tensor names come from the `gguf` package's own
`TensorNameMap`; metadata keys from `gguf.Keys`; the config is the `config.json` dict
transformers 5 writes for the family (`rope_parameters`, `layer_types`, ...), which
`ModelConfig.from_hf_dict` reads as it reads a folder's.

The specs live with the model code, which the API process (it reads a GGUF file's tokenizer
through this package) must not load: braid.models is imported inside the functions that need a
family.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import cache
from typing import TYPE_CHECKING, Any

import gguf
from gguf import MODEL_TENSOR, Keys

from braid.errors import UserError

if TYPE_CHECKING:
    from braid.models.spec import Architecture, GGUFMapping

Getter = Callable[..., Any]  # get(key template from gguf.Keys, default=None)


def family_of(arch: str, get: Getter, source: str) -> Architecture:
    """The Hugging Face architecture that serves a file of GGUF architecture `arch`; `UserError`
    listing the supported ones."""
    from braid.models.registry import GGUF_ARCHITECTURES  # model code: see the module's doc

    candidates = GGUF_ARCHITECTURES.get(arch)
    if candidates is None:
        raise UserError(f"{source}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    if len(candidates) == 1:
        return candidates[0]
    experts = (get(Keys.LLM.EXPERT_COUNT) or 0) > 0
    return next(c for c in candidates if c.gguf.experts == experts)


def _layout(mapping: GGUFMapping) -> re.Pattern:
    """transformers' names for a decoder-only family: embeddings, final norm and head; per
    layer `*_layernorm`s, `self_attn.*_proj` with per-head `q_norm`/`k_norm`, and the
    feed-forward's `*_proj`, router `gate` and experts."""
    return re.compile(
        r"model\.(embed_tokens|norm)|lm_head"
        r"|model\.layers\.\d+\.(\w+_layernorm|self_attn\.(\w+_proj|[qk]_norm)"
        rf"|{mapping.ffn_module}\.(\w+_proj|gate|experts\.{mapping.expert_leaf}))")


@cache
def tensor_names(mapping: GGUFMapping, block_count: int) -> dict[str, str]:
    """GGUF tensor name (without `.weight`/`.bias`) -> Hugging Face module name.

    `gguf.TensorNameMap` lists, for each GGUF tensor, every source name some converted model
    used; the family's is the first (in the package's order) that fits transformers' layout
    for the family (`_layout`). An architecture with an `ffn_up` but no `ffn_gate` stores the
    two gated projections fused in `ffn_up` (Phi-3's `gate_up_proj`). Stacked expert tensors
    map to the experts' module without an index (`mlp.experts.gate_proj`); `expert_name`
    puts one in.
    """
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == mapping.arch)
    fused_up = MODEL_TENSOR.FFN_GATE not in gguf.MODEL_TENSORS[arch]
    layout = _layout(mapping)
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


def config_dict(architecture: Architecture, get: Getter, shapes: Mapping[str, tuple[int, ...]],
                values: Callable[[str], list[float]]) -> dict:
    """The Hugging Face `config.json` dict of a GGUF file of `architecture`: the fields every
    family has, completed by the family's hook (`GGUFMapping.config`).

    `get` reads a metadata key (a `gguf.Keys` template), `shapes` holds every tensor's shape
    (PyTorch order) by GGUF name, and `values` reads a small tensor (rope factors).
    """
    from braid.models.spec import GGUFFile  # model code's package: see the module's doc

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
        "architectures": [architecture.name],
        "model_type": architecture.model_type,
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
    architecture.gguf.config(cfg, GGUFFile(get, shapes, values))
    return cfg
