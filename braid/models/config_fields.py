"""The strict config check: every Hugging Face config field of each supported architecture,
classified by what braid does with it.

The design rule: a config field that changes the computation and that braid does not implement
is an error, never ignored. Each field of an architecture's `transformers` config class (the
keys of `ConfigClass().to_dict()`), and the older or remote-code keys its checkpoints carry, is
one of

- implemented: braid reads it (some with a check of the values braid computes: rotary types,
  layer types, activations);
- no effect: it changes nothing at inference (training-only settings, labels, bookkeeping,
  values transformers derives from other fields and overwrites);
- neutral only: braid computes the field's neutral value only; a checkpoint setting anything
  else is refused with a `UserError` naming the field and its value.

Each family module classifies its architectures' fields in its spec (`Architecture.fields`,
built with `table` and the common lists and rules here). Keys a checkpoint has that its
architecture's table does not list are ignored, as transformers' own model code ignores them,
except the few in `GENERIC_FIELDS` that change any model's computation (quantized weights, a
partial rotary). tests/test_config_fields.py walks the config classes, so a field a new
transformers version adds fails it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from braid.errors import UserError
from braid.loader.model_config import rope_kind

IMPLEMENTED, NO_EFFECT, NEUTRAL = "implemented", "no effect", "neutral only"

# Rotary types braid computes (braid.layers.rotary). Phi-3 has its own (braid.models.phi3).
ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# Attention kinds of `layer_types` that braid's decoder layers build.
LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# SiLU-gated MLPs: Llama and the families built on it (Gemma's GeGLU: braid.models.gemma3).
SILU_ACTIVATIONS = frozenset({"silu"})

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


def table(implemented: Iterable[str] = (), no_effect: Iterable[str] = (),
          **rules: Rule) -> dict[str, Rule]:
    """An architecture's classification: the `implemented` and `no_effect` fields, and the
    fields with a rule of their own (a check, or neutral only)."""
    classified = {name: _IMPLEMENTED for name in implemented}
    classified.update({name: _NO_EFFECT for name in no_effect})
    classified.update(rules)
    return classified


# Generic PretrainedConfig fields and bookkeeping every class has: none changes the forward
# pass (braid picks its own dtype; bos/pad only matter to tokenization and training).
COMMON_NO_EFFECT = (
    "transformers_version", "architectures", "model_type", "_name_or_path", "dtype",
    "torch_dtype", "output_hidden_states", "output_attentions", "return_dict", "use_cache",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "initializer_range", "bos_token_id", "pad_token_id", "attention_dropout", "auto_map",
)
# What `ModelConfig.from_hf_dict` reads for every architecture (rope_theta also as a top-level
# key of configs written before transformers 5 moved it into rope_parameters).
COMMON_IMPLEMENTED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
)
ROPE = rope_rule(ROPE_TYPES)
SILU = one_of(SILU_ACTIVATIONS)
# The rules of the rotary and activation fields most architectures share.
COMMON_RULES = dict(rope_parameters=ROPE, rope_scaling=ROPE, hidden_act=SILU)
# Mixture-of-experts training settings: the auxiliary load-balancing loss and its logits.
ROUTER_TRAINING = ("output_router_logits", "router_aux_loss_coef")


def _check_quantization(architecture: str, field: str, value: Any) -> None:
    """AWQ's "gemm" layout at 4 bits and GPTQ at 4 or 8 bits (`braid.loader.awq_gptq`)."""
    if not value:
        return
    supported = ("AWQ (version gemm, 4 bits with zero points) and GPTQ (4 or 8 bits) "
                 "checkpoints, or unquantized ones")
    method = value.get("quant_method")
    bits = value.get("bits", value.get("w_bit"))
    if method == "awq":
        checks = [("version", str(value.get("version", "gemm")).lower() == "gemm"),
                  ("zero_point", value.get("zero_point", True) is True), ("bits", bits == 4)]
    elif method == "gptq":
        checks = [("bits", bits in (4, 8)),
                  ("checkpoint_format",
                   value.get("checkpoint_format", "gptq") in ("gptq", "gptq_v2"))]
    else:
        checks = [("quant_method", False)]
    for key, holds in checks:
        if not holds:
            refuse(architecture, f"{field}.{key}", bits if key == "bits" else value.get(key),
                   supported)


# Keys no architecture's table lists that change any model's computation: quantized weights
# (braid reads unquantized safetensors and AWQ/GPTQ ones), and a rotary over part of each head
# (transformers moves a top-level partial_rotary_factor into every model's rotary parameters).
GENERIC_FIELDS: dict[str, Rule] = {
    "quantization_config": Rule(IMPLEMENTED, _check_quantization),
    "compression_config": neutral(None, {}, supported="unquantized checkpoints only"),
    "partial_rotary_factor": neutral(1.0, None),
}


def check_config_fields(architecture: str, hf_config: dict) -> None:
    """Raise a `UserError` naming the first field of `hf_config` (a `config.json` dict) whose
    value changes the computation in a way braid does not implement. `architecture` must be
    one the registry serves."""
    # Imported here: the registry imports the family modules, which import this one.
    from braid.models.registry import ARCHITECTURES

    rules = ARCHITECTURES[architecture].fields
    for field, value in hf_config.items():
        rule = rules.get(field) or GENERIC_FIELDS.get(field)
        if rule is not None and rule.check is not None:
            rule.check(architecture, field, value)
