"""Phi-3: Llama with fused `qkv_proj` and `gate_up_proj` checkpoint tensors (split per rank as
they are read), LongRoPE frequencies and an optional sliding window."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from braid.layers.rotary import RotaryEmbedding
from braid.loader.model_config import ModelConfig, rope_kind
from braid.loader.weights import LazyWeight, RowSlice
from braid.models.llama import LlamaForCausalLM


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
