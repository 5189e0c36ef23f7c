"""Qwen2/2.5 (biases on Q, K and V), Qwen3 (RMSNorm on each query and key head) and Qwen3-MoE
(Qwen3 with sparse MoE layers), with their optional sliding window."""

from __future__ import annotations

import torch
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.mlp import GatedMLP
from braid.layers.moe import RouterConfig, SparseMoE, expert_checkpoint_param
from braid.loader.model_config import ModelConfig
from braid.models.llama import LlamaForCausalLM, per_head_rms_norm


def qwen_layer_window(config: ModelConfig, index: int) -> int | None:
    """Layer `index`'s sliding window, as transformers reads a Qwen config: only with
    `use_sliding_window`, and then on the layers `layer_types` marks sliding (by default
    those from `max_window_layers` on)."""
    cfg = config.extra
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        return None
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if i >= cfg.get("max_window_layers", 0) else "full_attention"
        for i in range(config.num_layers)]
    return cfg["sliding_window"] if kinds[index] == "sliding_attention" else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with biases on the Q, K and V projections (never on the output's)."""

    @classmethod
    def attention_options(cls, config: ModelConfig, index: int, dtype: torch.dtype) -> dict:
        return dict(qkv_bias=True, window=qwen_layer_window(config, index))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with an RMSNorm on each query and key head before the rotary."""

    @classmethod
    def attention_options(cls, config: ModelConfig, index: int, dtype: torch.dtype) -> dict:
        bias = bool(config.extra.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, head_norm=per_head_rms_norm(config, dtype),
                    window=qwen_layer_window(config, index))




class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 whose MLPs are sparse MoEs (softmax over the experts, the top k renormalised where
    `norm_topk_prob`), except the layers `mlp_only_layers` lists and those
    `decoder_sparse_step` skips. A sliding window, where used, covers every layer."""

    @classmethod
    def attention_options(cls, config: ModelConfig, index: int, dtype: torch.dtype) -> dict:
        cfg = config.extra
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        return {**super().attention_options(config, index, dtype), "window": window}

    @classmethod
    def make_mlp(cls, config: ModelConfig, comm: Communicator, dtype: torch.dtype,
                 index: int) -> nn.Module:
        cfg = config.extra
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
        step = cfg.get("decoder_sparse_step", 1)
        sparse = (index not in (cfg.get("mlp_only_layers") or []) and experts > 0
                  and (index + 1) % step == 0)
        if not sparse:
            return GatedMLP(config.hidden_size, config.intermediate_size, comm, dtype)
        router = RouterConfig.softmax_top_k(experts, cfg["num_experts_per_tok"],
                                            renormalize=bool(cfg.get("norm_topk_prob")))
        return SparseMoE(config.hidden_size, cfg["moe_intermediate_size"], router, comm, dtype)

    def checkpoint_param(self, name: str) -> tuple[str, object] | None:
        """Each expert's gate/up/down go into the stacked expert parameters."""
        return expert_checkpoint_param(name)
