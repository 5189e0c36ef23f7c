"""The strict config check: every Hugging Face config field of each supported architecture,
classified by what braid does with it.

The design rule: a config field that changes the computation and that braid does not implement
is an error, never ignored. Each field of an architecture's `transformers` config class (the
keys of `ConfigClass().to_dict()`, listed in `HF_CONFIG_CLASSES`), and the older or
remote-code keys its checkpoints carry, is one of

- implemented: braid reads it (some with a check of the values braid computes: rotary types,
  layer types, activations);
- no effect: it changes nothing at inference (training-only settings, labels, bookkeeping,
  values transformers derives from other fields and overwrites);
- neutral only: braid computes the field's neutral value only; a checkpoint setting anything
  else is refused with a `UserError` naming the field and its value.

Keys a checkpoint has that its architecture's table does not list are ignored, as transformers'
own model code ignores them, except the few in `GENERIC_FIELDS` that change any model's
computation (quantized weights, a partial rotary). tests/test_config_fields.py walks the
config classes, so a field a new transformers version adds fails it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from braid.errors import UserError
from braid.loader.model_config import rope_kind

IMPLEMENTED, NO_EFFECT, NEUTRAL = "implemented", "no effect", "neutral only"

# Rotary types braid computes (braid.layers.rotary). Phi-3 adds LongRoPE (PHI3_ROPE_TYPES).
ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# transformers' Phi-3 config reads only default and LongRoPE; "su" is LongRoPE's older name.
# Its "yarn" is also renamed to LongRoPE there, so braid must not compute YaRN for it.
PHI3_ROPE_TYPES = frozenset({"default", "longrope", "su"})
# Attention kinds of `layer_types` that braid's decoder layers build.
LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# MLP activations: SiLU-gated (Llama and the families built on it), GeGLU with tanh (Gemma).
SILU_ACTIVATIONS = frozenset({"silu"})
GEMMA_ACTIVATIONS = frozenset({"gelu_pytorch_tanh"})

# The transformers config class of each architecture (for the test that walks their fields).
HF_CONFIG_CLASSES = {
    "DeepseekV2ForCausalLM": "DeepseekV2Config",
    "DeepseekV3ForCausalLM": "DeepseekV3Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "Phi3ForCausalLM": "Phi3Config",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
}

Check = Callable[[str, str, Any], None]


@dataclass(frozen=True)
class Rule:
    """How braid treats one config field: `kind` (IMPLEMENTED, NO_EFFECT or NEUTRAL) and an
    optional `check(architecture, field, value)` that raises a `UserError` for a value braid
    does not compute."""

    kind: str
    check: Check | None = None


def refuse(architecture: str, field: str, value: Any, supported: str) -> NoReturn:
    """Raise the `UserError` of a config value braid does not compute."""
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise UserError(f"{architecture}: config field {field!r} = {shown} changes the computation "
                    f"and braid does not implement it (braid supports {supported})")


def neutral(*values: Any, supported: str | None = None) -> Rule:
    """A field braid supports only at these values (the first is the one braid computes;
    the others mean the same, e.g. None for "absent"); `supported` words them for the
    message."""

    def check(architecture: str, field: str, value: Any) -> None:
        if not any(_same(value, v) for v in values):
            refuse(architecture, field, value, supported or f"{values[0]!r} only")

    return Rule(NEUTRAL, check)


def _same(value: Any, expected: Any) -> bool:
    # Booleans and None by identity: 1 == True and 0 == False would let numbers through.
    if isinstance(value, bool) or isinstance(expected, bool) or expected is None:
        return value is expected
    return value == expected


def one_of(allowed: frozenset[str]) -> Rule:
    """An implemented field whose value must be one of `allowed` (None: the class default)."""

    def check(architecture: str, field: str, value: Any) -> None:
        if value is not None and value not in allowed:
            refuse(architecture, field, value, ", ".join(sorted(allowed)))

    return Rule(IMPLEMENTED, check)


def rope_rule(allowed: frozenset[str]) -> Rule:
    """`rope_parameters` / `rope_scaling`: one dict, or one per layer type (Gemma 3), each of a
    rotary type in `allowed` and rotating whole heads."""

    def check_one(architecture: str, field: str, params: Any) -> None:
        if params is None:
            return
        if not isinstance(params, dict):
            refuse(architecture, field, params, "a dict of rotary parameters")
        kind = rope_kind(params)
        if kind not in allowed:
            key = "rope_type" if "rope_type" in params else "type"
            refuse(architecture, f"{field}.{key}", kind, ", ".join(sorted(allowed)))
        factor = params.get("partial_rotary_factor")
        if factor is not None and factor != 1.0:
            refuse(architecture, f"{field}.partial_rotary_factor", factor, "1.0 only")

    def check(architecture: str, field: str, value: Any) -> None:
        # transformers nests the parameters by layer type when every value is a dict.
        if isinstance(value, dict) and value and all(isinstance(v, dict)
                                                     for v in value.values()):
            for layer_type, params in value.items():
                if layer_type not in LAYER_TYPES:
                    refuse(architecture, f"{field}.{layer_type}", params,
                           f"layer types {', '.join(sorted(LAYER_TYPES))}")
                check_one(architecture, f"{field}.{layer_type}", params)
        else:
            check_one(architecture, field, value)

    return Rule(IMPLEMENTED, check)


def _check_layer_types(architecture: str, field: str, value: Any) -> None:
    for kind in value or ():
        if kind not in LAYER_TYPES:
            refuse(architecture, field, kind, ", ".join(sorted(LAYER_TYPES)))


_IMPLEMENTED = Rule(IMPLEMENTED)
_NO_EFFECT = Rule(NO_EFFECT)
LAYER_TYPES_RULE = Rule(IMPLEMENTED, _check_layer_types)


def _table(implemented: Iterable[str] = (), no_effect: Iterable[str] = (),
           **rules: Rule) -> dict[str, Rule]:
    table = {name: _IMPLEMENTED for name in implemented}
    table.update({name: _NO_EFFECT for name in no_effect})
    table.update(rules)
    return table


# Generic PretrainedConfig fields and bookkeeping every class has: none changes the forward
# pass (braid picks its own dtype; bos/pad only matter to tokenization and training).
_COMMON_NO_EFFECT = (
    "transformers_version", "architectures", "model_type", "_name_or_path", "dtype",
    "torch_dtype", "output_hidden_states", "output_attentions", "return_dict", "use_cache",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "initializer_range", "bos_token_id", "pad_token_id", "attention_dropout", "auto_map",
)
# What `ModelConfig.from_hf_dict` reads for every architecture (rope_theta also as a top-level
# key of configs written before transformers 5 moved it into rope_parameters).
_COMMON_IMPLEMENTED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
)
_ROPE = rope_rule(ROPE_TYPES)
_SILU = one_of(SILU_ACTIVATIONS)
_COMMON = dict(rope_parameters=_ROPE, rope_scaling=_ROPE, hidden_act=_SILU)
# Mixture-of-experts training settings: the auxiliary load-balancing loss and its logits.
_ROUTER_TRAINING = ("output_router_logits", "router_aux_loss_coef")

_LLAMA = _table(
    _COMMON_IMPLEMENTED + ("attention_bias",), _COMMON_NO_EFFECT + (
        # transformers 4 split the MLP GEMMs into this many slices and summed them: the same
        # product; transformers 5 no longer reads it.
        "pretraining_tp",),
    **_COMMON, mlp_bias=neutral(False, None))

_MISTRAL = _table(_COMMON_IMPLEMENTED + ("sliding_window",), _COMMON_NO_EFFECT, **_COMMON)

# Qwen2 and Qwen3: windowed layers from `max_window_layers` on when `use_sliding_window`
# (transformers derives `layer_types` from them); Qwen3's q/k norms have no field.
_QWEN_WINDOWS = ("use_sliding_window", "sliding_window", "max_window_layers")
_QWEN2 = _table(_COMMON_IMPLEMENTED + _QWEN_WINDOWS, _COMMON_NO_EFFECT, **_COMMON,
                layer_types=LAYER_TYPES_RULE)
_QWEN3 = _table(_COMMON_IMPLEMENTED + _QWEN_WINDOWS + ("attention_bias",), _COMMON_NO_EFFECT,
                **_COMMON, layer_types=LAYER_TYPES_RULE)

_QWEN3_MOE = _table(
    _COMMON_IMPLEMENTED + (
        "attention_bias", "use_sliding_window", "sliding_window", "decoder_sparse_step",
        "moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob", "mlp_only_layers",
        # transformers' attribute name for `num_experts` (what its to_dict writes)
        "num_experts", "num_local_experts"),
    _COMMON_NO_EFFECT + _ROUTER_TRAINING + (
        # In the hub configs, but transformers' Qwen3-MoE windows every layer when
        # use_sliding_window is set, whatever this says.
        "max_window_layers",),
    **_COMMON)

_MIXTRAL = _table(
    _COMMON_IMPLEMENTED + ("sliding_window", "num_local_experts", "num_experts_per_tok"),
    _COMMON_NO_EFFECT + _ROUTER_TRAINING + (
        # multiplies the router input by noise in training only
        "router_jitter_noise",),
    **_COMMON)

_GEMMA3 = _table(
    _COMMON_IMPLEMENTED + (
        "attention_bias", "query_pre_attn_scalar", "sliding_window",
        # layer kinds from a pattern (older configs, and transformers' private copy of it)
        "sliding_window_pattern", "_sliding_window_pattern",
        # the local layers' rotary base in configs before transformers 5
        "rope_local_base_freq"),
    _COMMON_NO_EFFECT + (
        # a generation-time cache choice
        "cache_implementation",
        # not read by transformers' Gemma 3 (hidden_activation is)
        "hidden_act"),
    rope_parameters=_ROPE, rope_scaling=_ROPE, layer_types=LAYER_TYPES_RULE,
    hidden_activation=one_of(GEMMA_ACTIVATIONS),
    attn_logit_softcapping=neutral(None), final_logit_softcapping=neutral(None),
    use_bidirectional_attention=neutral(False, None))

_PHI3_ROPE = rope_rule(PHI3_ROPE_TYPES)
_PHI3 = _table(
    _COMMON_IMPLEMENTED + ("sliding_window", "original_max_position_embeddings"),
    _COMMON_NO_EFFECT + ("resid_pdrop", "embd_pdrop"),
    rope_parameters=_PHI3_ROPE, rope_scaling=_PHI3_ROPE, hidden_act=_SILU)

# DeepSeek (braid.models.deepseek_v2, braid.layers.mla, braid.layers.moe), with the keys of the
# original remote-code configs transformers' classes do not define.
_DEEPSEEK_IMPLEMENTED = tuple(f for f in _COMMON_IMPLEMENTED if f != "head_dim") + (
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "first_k_dense_replace", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "n_group", "topk_group", "topk_method", "scoring_func",
    "norm_topk_prob", "routed_scaling_factor", "rope_interleave")
_DEEPSEEK_NO_EFFECT = _COMMON_NO_EFFECT + (
    # transformers derives both from the rotary and nope dims and overwrites them
    "head_dim", "qk_head_dim",
    "pretraining_tp", "output_router_logits",
    # the remote code's training losses and its expert-parallel layout
    "aux_loss_alpha", "seq_aux", "ep_size",
    # V3's multi-token-prediction layers: braid skips their weights and predicts one token
    "num_nextn_predict_layers")
_DEEPSEEK = _table(
    _DEEPSEEK_IMPLEMENTED, _DEEPSEEK_NO_EFFECT, **_COMMON,
    mlp_bias=neutral(False, None), attention_bias=neutral(False, None),
    # The remote code makes a layer MoE when layer % moe_layer_freq == 0 (past the first
    # dense ones); braid makes every such layer MoE.
    moe_layer_freq=neutral(1, None))

FIELDS: dict[str, dict[str, Rule]] = {
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
    "Gemma3ForCausalLM": _GEMMA3,
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _MISTRAL,
    "MixtralForCausalLM": _MIXTRAL,
    "Phi3ForCausalLM": _PHI3,
    "Qwen2ForCausalLM": _QWEN2,
    "Qwen3ForCausalLM": _QWEN3,
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
}

# Keys no architecture's table lists that change any model's computation: quantized weights
# (braid reads unquantized safetensors), and a rotary over part of each head (transformers
# moves a top-level partial_rotary_factor into every model's rotary parameters).
GENERIC_FIELDS: dict[str, Rule] = {
    "quantization_config": neutral(None, {}, supported="unquantized checkpoints only"),
    "compression_config": neutral(None, {}, supported="unquantized checkpoints only"),
    "partial_rotary_factor": neutral(1.0, None),
}


def check_config_fields(architecture: str, hf_config: dict) -> None:
    """Raise a `UserError` naming the first field of `hf_config` (a `config.json` dict) whose
    value changes the computation in a way braid does not implement. `architecture` must be
    one of `FIELDS` (every architecture the registry serves)."""
    rules = FIELDS[architecture]
    for field, value in hf_config.items():
        rule = rules.get(field) or GENERIC_FIELDS.get(field)
        if rule is not None and rule.check is not None:
            rule.check(architecture, field, value)
