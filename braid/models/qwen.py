"""Qwen2/2.5 (biases on Q, K and V), Qwen3 (RMSNorm on each query and key head) and Qwen3-MoE
(Qwen3 with sparse MoE layers), with their optional sliding window."""

from __future__ import annotations

import torch
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.mlp import GatedMLP
from braid.layers.moe import RouterConfig, SparseMoE, expert_checkpoint_param
from braid.loader.model_config import ModelConfig
from braid.models.config_fields import (
    COMMON_IMPLEMENTED,
    COMMON_NO_EFFECT,
    COMMON_RULES,
    LAYER_TYPES_RULE,
    ROUTER_TRAINING,
    table,
)
from braid.models.llama import LlamaForCausalLM, per_head_rms_norm
from braid.models.spec import (
    BENCH,
    TINY,
    TINY_WINDOW,
    Architecture,
    GGUFFile,
    GGUFMapping,
    RandomModel,
)


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


# The family's spec (braid.models.spec).

def _qwen_gguf_config(cfg: dict, file: GGUFFile) -> None:
    """Qwen2/3: no sliding window (llama.cpp reads none); Qwen3's optional attention bias;
    Qwen3-MoE's experts, which llama.cpp always renormalises over the chosen ones
    (`build_moe_ffn(..., norm_w=true)` in src/models/qwen3moe.cpp) unless the file says."""
    from gguf import Keys  # the gguf package only where a GGUF file is read (spec.GGUFMapping)

    layers, experts = cfg["num_hidden_layers"], cfg.get("num_local_experts", 0)
    cfg.update(use_sliding_window=False, sliding_window=None)
    if not experts:  # (transformers' Qwen3-MoE config has neither)
        cfg.update(max_window_layers=layers, layer_types=["full_attention"] * layers)
    if cfg["model_type"] != "qwen2":  # Qwen2 always has q/k/v biases and no field for them
        cfg["attention_bias"] = "blk.0.attn_q.bias" in file.shapes
    if experts:
        norm = file.get(Keys.LLM.EXPERT_WEIGHTS_NORM)
        cfg.update(num_experts=experts,
                   moe_intermediate_size=int(file.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
                   norm_topk_prob=True if norm is None else bool(norm),
                   decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(layers)
                                    if f"blk.{i}.ffn_gate_inp.weight" not in file.shapes])


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

# Windowed layers from `max_window_layers` on when `use_sliding_window` (transformers derives
# `layer_types` from them); Qwen3's q/k norms have no field.
_WINDOWS = ("use_sliding_window", "sliding_window", "max_window_layers")

FAMILY = (
    Architecture(
        "Qwen2ForCausalLM", Qwen2ForCausalLM, model_type="qwen2", hf_config_class="Qwen2Config",
        fields=table(COMMON_IMPLEMENTED + _WINDOWS, COMMON_NO_EFFECT, **COMMON_RULES,
                     layer_types=LAYER_TYPES_RULE),
        gguf=GGUFMapping("qwen2", _qwen_gguf_config),
        # Q/K/V biases by design. tiny: windowed layers from `max_window_layers` on
        # (transformers derives layer_types [full, sliding, sliding]); bench: Qwen2.5-1.5B,
        # tied embeddings.
        random=RandomModel("qwen2", chat_template=_QWEN2_TEMPLATE, presets={
            "tiny": dict(**TINY, num_hidden_layers=3, use_sliding_window=True,
                         sliding_window=TINY_WINDOW, max_window_layers=1),
            "bench": dict(**BENCH, hidden_size=1536, intermediate_size=8960,
                          num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=2,
                          tie_word_embeddings=True,
                          rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        })),
    Architecture(
        "Qwen3ForCausalLM", Qwen3ForCausalLM, model_type="qwen3", hf_config_class="Qwen3Config",
        fields=table(COMMON_IMPLEMENTED + _WINDOWS + ("attention_bias",), COMMON_NO_EFFECT,
                     **COMMON_RULES, layer_types=LAYER_TYPES_RULE),
        gguf=GGUFMapping("qwen3", _qwen_gguf_config),
        # Per-head q/k norms and a head dim that is not hidden / heads (9 x 32 = 288 != 144),
        # tied embeddings, as Qwen3's small models; bench: Qwen3-1.7B.
        random=RandomModel("qwen3", chat_template=_QWEN3_TEMPLATE, presets={
            "tiny": dict(**TINY, head_dim=32, num_hidden_layers=2, tie_word_embeddings=True),
            "bench": dict(**BENCH, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, tie_word_embeddings=True,
                          rope_parameters=dict(rope_type="default", rope_theta=1e6)),
            # Qwen3-8B's exact shape, its 151,936-entry vocabulary included
            "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960,
                       rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        })),
    Architecture(
        "Qwen3MoeForCausalLM", Qwen3MoeForCausalLM, model_type="qwen3_moe",
        hf_config_class="Qwen3MoeConfig",
        fields=table(
            COMMON_IMPLEMENTED + (
                "attention_bias", "use_sliding_window", "sliding_window",
                "decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok",
                "norm_topk_prob", "mlp_only_layers",
                # transformers' attribute name for `num_experts` (what its to_dict writes)
                "num_experts", "num_local_experts"),
            COMMON_NO_EFFECT + ROUTER_TRAINING + (
                # In the hub configs, but transformers' Qwen3-MoE windows every layer when
                # use_sliding_window is set, whatever this says.
                "max_window_layers",),
            **COMMON_RULES),
        gguf=GGUFMapping("qwen3moe", _qwen_gguf_config),
        # tiny: 8 experts top-2 with renormalised weights, 52 expert columns (uneven over 3
        # ranks), the middle layer dense (mlp_only_layers); bench: Qwen3-30B-A3B's widths with
        # 32 experts.
        random=RandomModel("qwen3_moe", chat_template=_QWEN3_TEMPLATE, presets={
            "tiny": dict(**TINY, head_dim=32, num_hidden_layers=3, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=52,
                         decoder_sparse_step=1, mlp_only_layers=[1]),
            "bench": dict(**BENCH, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=32, num_experts_per_tok=8,
                          norm_topk_prob=True, moe_intermediate_size=768,
                          rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        })),
)
