"""Phi-3: Llama with fused `qkv_proj` and `gate_up_proj` checkpoint tensors (split per rank as
they are read), LongRoPE frequencies and an optional sliding window."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from braid.layers.rotary import RotaryEmbedding
from braid.loader.model_config import ModelConfig, rope_kind
from braid.loader.weights import LazyWeight, RowSlice
from braid.models.config_fields import (
    COMMON_IMPLEMENTED,
    COMMON_NO_EFFECT,
    SILU,
    rope_rule,
    table,
)
from braid.models.llama import LlamaForCausalLM
from braid.models.spec import (
    BENCH,
    TINY,
    TINY_WINDOW,
    Architecture,
    GGUFFile,
    GGUFMapping,
    RandomModel,
)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-3.5 (a partial rotary, as Phi-4-mini's, is refused by
    `config_fields`)."""

    @classmethod
    def attention_options(cls, config: ModelConfig, index: int, dtype: torch.dtype) -> dict:
        return dict(window=config.extra.get("sliding_window"))

    @classmethod
    def make_rotary(cls, config: ModelConfig) -> RotaryEmbedding:
        """LongRoPE's factors with the original context and the stretch they serve, which
        transformers reads from the config's top level (`rope_scaling` type "su" is its older
        name)."""
        scaling = config.rope_scaling
        if scaling is not None and rope_kind(scaling) in ("longrope", "su"):
            top_level = config.extra.get("original_max_position_embeddings")
            scaling = {**scaling, "rope_type": "longrope",
                       "original_max_position_embeddings":
                           top_level or scaling["original_max_position_embeddings"],
                       "factor": (config.max_position_embeddings / top_level if top_level
                                  else scaling.get("factor", 1.0))}
        return RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                               config.rope_theta, scaling)

    def checkpoint_parts(self, name: str,
                         weight: LazyWeight) -> Iterable[tuple[str, LazyWeight]]:
        """`qkv_proj` as `q_proj`, `k_proj`, `v_proj`; `gate_up_proj` as `gate_proj` and
        `up_proj`: row ranges of the fused tensor, each read only for this rank's heads or
        columns by the usual loaders."""
        config = self.config
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".self_attn.qkv_proj"):
            d = config.head_dim
            sizes = {"q_proj": config.num_heads * d, "k_proj": config.num_kv_heads * d,
                     "v_proj": config.num_kv_heads * d}
        elif prefix.endswith(".mlp.gate_up_proj"):
            sizes = {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
        else:
            return ((name, weight),)
        base = prefix.rpartition(".")[0]
        parts, offset = [], 0
        for part, rows in sizes.items():
            parts.append((f"{base}.{part}.{leaf}", RowSlice(weight, offset, rows)))
            offset += rows
        return parts


# The family's spec (braid.models.spec).

# The LongRoPE factors, which llama.cpp writes as tensors (conversion/phi.py, Phi3MiniModel).
_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _phi3_gguf_config(cfg: dict, file: GGUFFile) -> None:
    """Phi-3 (conversion/phi.py, Phi3MiniModel): the original context as rope scaling's, the
    LongRoPE factors as the tensors `rope_factors_long`/`_short`, the window 0 when none."""
    from gguf import Keys  # the gguf package only where a GGUF file is read (spec.GGUFMapping)

    original = file.get(Keys.Rope.SCALING_ORIG_CTX_LEN)
    original = int(original) if original else cfg["max_position_embeddings"]
    window = file.get(Keys.Attention.SLIDING_WINDOW)
    cfg.update(original_max_position_embeddings=original,
               sliding_window=int(window) if window else None)
    cfg["rope_parameters"].setdefault("partial_rotary_factor", 1.0)  # transformers' Phi-3 has it
    if _ROPE_FACTOR_TENSORS[0] in file.shapes:
        long_factor, short_factor = (file.values(name) for name in _ROPE_FACTOR_TENSORS)
        cfg["rope_parameters"].update(rope_type="longrope", long_factor=long_factor,
                                      short_factor=short_factor,
                                      original_max_position_embeddings=original)


_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|' ~ message['role'] ~ '|>\\n' ~ (message['content'] or '') ~ '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)
# transformers' Phi-3 config reads only default and LongRoPE; "su" is LongRoPE's older name.
# Its "yarn" is also renamed to LongRoPE there, so braid must not compute YaRN for it.
_ROPE = rope_rule(frozenset({"default", "longrope", "su"}))

FAMILY = (
    Architecture(
        "Phi3ForCausalLM", Phi3ForCausalLM, model_type="phi3", hf_config_class="Phi3Config",
        fields=table(
            COMMON_IMPLEMENTED + ("sliding_window", "original_max_position_embeddings"),
            COMMON_NO_EFFECT + ("resid_pdrop", "embd_pdrop"),
            rope_parameters=_ROPE, rope_scaling=_ROPE, hidden_act=SILU),
        gguf=GGUFMapping("phi3", _phi3_gguf_config, config_tensors=_ROPE_FACTOR_TENSORS),
        # Fused qkv_proj and gate_up_proj tensors; a window on every layer, as
        # Phi-3-mini-4k's 2047; bench: Phi-3-mini's widths (multi-head attention).
        random=RandomModel("phi3", chat_template=_CHAT_TEMPLATE, presets={
            "tiny": dict(**TINY, num_hidden_layers=2, sliding_window=TINY_WINDOW,
                         original_max_position_embeddings=2048),
            "bench": dict(**BENCH, hidden_size=3072, intermediate_size=8192,
                          num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=32,
                          sliding_window=2047, original_max_position_embeddings=8192),
        })),
)
