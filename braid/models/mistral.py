"""Mistral (Llama with a sliding window on every layer) and Mixtral (Mistral with a sparse MoE
in place of each MLP)."""

from __future__ import annotations

import re

import torch
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.moe import RouterConfig, SparseMoE
from braid.loader.model_config import ModelConfig
from braid.models.llama import LlamaForCausalLM


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
