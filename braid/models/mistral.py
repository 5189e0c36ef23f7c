"""Mistral (Llama with a sliding window on every layer) and Mixtral (Mistral with a sparse MoE
in place of each MLP)."""

from __future__ import annotations

import re

import torch
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.moe import RouterConfig, SparseMoE
from braid.loader.model_config import ModelConfig
from braid.models.config_fields import (
    COMMON_IMPLEMENTED,
    COMMON_NO_EFFECT,
    COMMON_RULES,
    ROUTER_TRAINING,
    table,
)
from braid.models.llama import LlamaForCausalLM, llama_gguf_config
from braid.models.spec import (
    BENCH,
    TINY,
    TINY_WINDOW,
    Architecture,
    GGUFFile,
    GGUFMapping,
    RandomModel,
)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama whose every layer sees only the last `sliding_window` keys (when the config sets
    one; Mistral 7B v0.1 does, later versions do not)."""

    @classmethod
    def attention_options(cls, config: ModelConfig, index: int, dtype: torch.dtype) -> dict:
        return dict(window=config.extra.get("sliding_window"))


# Mixtral's checkpoint names of an expert's tensors: w1 the gate, w3 the up, w2 the down
# projection.
_MIXTRAL_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(MistralForCausalLM):
    """Mistral with a MoE in every layer: softmax over the experts, the top k renormalised."""

    @classmethod
    def make_mlp(cls, config: ModelConfig, comm: Communicator, dtype: torch.dtype,
                 index: int) -> nn.Module:
        cfg = config.extra
        router = RouterConfig.softmax_top_k(cfg["num_local_experts"], cfg["num_experts_per_tok"],
                                            renormalize=True)
        return SparseMoE(config.hidden_size, config.intermediate_size, router, comm, dtype)

    def checkpoint_param(self, name: str) -> tuple[str, object] | None:
        """`block_sparse_moe.gate` is the router (`mlp.gate`); each expert's w1/w3/w2 go into
        the stacked expert parameters."""
        if ".block_sparse_moe.gate." in name:
            return name.replace(".block_sparse_moe.", ".mlp."), None
        match = _MIXTRAL_EXPERT.fullmatch(name)
        if match is None:
            return None
        prefix, expert, part = match.groups()
        param = "w2" if part == "w2" else "w13"
        return f"{prefix}.mlp.experts.{param}", (int(expert), _MIXTRAL_PARTS[part])


# The family's spec (braid.models.spec).

def _mixtral_gguf_config(cfg: dict, file: GGUFFile) -> None:
    """Llama's fields, and no window: llama.cpp reads none for Mixtral."""
    llama_gguf_config(cfg, file)
    cfg["sliding_window"] = None


# [INST] turns after the BOS; a system message goes in front of the first user turn; an answer
# ends with EOS. The model answers right after [/INST]: no generation prompt.
_CHAT_TEMPLATE = (
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

FAMILY = (
    Architecture(
        "MistralForCausalLM", MistralForCausalLM, model_type="mistral",
        hf_config_class="MistralConfig",
        fields=table(COMMON_IMPLEMENTED + ("sliding_window",), COMMON_NO_EFFECT,
                     **COMMON_RULES),
        # Mistral-7B-v0.1's window (v0.2 and later have none); bench: the Llama bench widths.
        random=RandomModel("mistral", chat_template=_CHAT_TEMPLATE, presets={
            "tiny": dict(**TINY, head_dim=16, num_hidden_layers=2, sliding_window=TINY_WINDOW),
            "bench": dict(**BENCH, hidden_size=2048, intermediate_size=5632,
                          num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                          head_dim=128, sliding_window=4096,
                          rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        })),
    Architecture(
        "MixtralForCausalLM", MixtralForCausalLM, model_type="mixtral",
        hf_config_class="MixtralConfig",
        fields=table(
            COMMON_IMPLEMENTED + ("sliding_window", "num_local_experts", "num_experts_per_tok"),
            COMMON_NO_EFFECT + ROUTER_TRAINING + (
                # multiplies the router input by noise in training only
                "router_jitter_noise",),
            **COMMON_RULES),
        # Converted as `llama` with stacked experts; transformers keeps Mixtral's own names
        # (`block_sparse_moe`, experts' `w1`/`w2`/`w3`) in its checkpoints.
        gguf=GGUFMapping("llama", _mixtral_gguf_config, experts=True, rotary_permuted=True,
                         ffn_module="block_sparse_moe", expert_leaf=r"w[123]"),
        # 8 experts top-2 as Mixtral-8x7B; no window, as Mixtral's checkpoints.
        random=RandomModel("mixtral", chat_template=_CHAT_TEMPLATE, presets={
            "tiny": dict(**TINY, num_hidden_layers=2, num_local_experts=8,
                         num_experts_per_tok=2),
            "bench": dict(**BENCH, hidden_size=2048, intermediate_size=4096,
                          num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                          num_local_experts=8, num_experts_per_tok=2,
                          rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        })),
)
