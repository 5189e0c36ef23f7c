"""Gemma 3 (text): local sliding-window layers interleaved with global ones, each kind with its
own rotary base, `(1 + w)` RMSNorms (also on each query and key head), a norm after each
block as well as before, the embedding scaled by sqrt(hidden), GeGLU MLPs and a softmax scale
from `query_pre_attn_scalar`.

Per layer, as operations: `norm, qkv, head norms, rotary | attention | o_proj -> launch
all-reduce | YIELD | wait, post-attention norm, residual, pre-MLP norm, MLP -> launch
all-reduce | YIELD | wait, post-MLP norm, residual` (the last operation runs in the next
layer's first stage, as Llama's wait does). The residual stream is kept whole in the state
("residual"), since each block's sum is normalised before it is added.
"""

from __future__ import annotations

import torch

from braid.distributed.comm import Communicator
from braid.layers.forward_batch import ForwardBatch
from braid.layers.mlp import GatedMLP
from braid.layers.norm import OffsetRMSNorm
from braid.layers.rotary import RotaryEmbedding
from braid.loader.model_config import ModelConfig, rope_kind
from braid.models.common import DecoderModel
from braid.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from braid.overlap.operations import YIELD, State

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma_layer_types(config: ModelConfig) -> list[str]:
    """Each layer's kind: `layer_types`, or from the older `sliding_window_pattern` (every
    pattern-th layer global, the others local)."""
    cfg = config.extra
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_layers)]


def gemma_rotary(config: ModelConfig, kind: str) -> RotaryEmbedding:
    """The rotary of one kind of layer: transformers 5 keeps a `rope_parameters` dict per
    kind; older configs give the global base and scaling at the top level and the local base
    as `rope_local_base_freq`."""
    cfg = config.extra
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and kind in params:
        params = params[kind]
        theta = params["rope_theta"]
    elif kind == SLIDING:
        params, theta = None, cfg.get("rope_local_base_freq", 10000.0)
    else:
        params, theta = cfg.get("rope_scaling"), cfg.get("rope_theta", 1000000.0)
    scaling = None if rope_kind(params) == "default" else params
    return RotaryEmbedding(config.head_dim, config.max_position_embeddings, float(theta),
                           scaling)


def _norm(size: int, eps: float, dtype: torch.dtype) -> OffsetRMSNorm:
    return OffsetRMSNorm(size, eps, dtype)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Sandwich norms around both blocks (see the module docstring)."""

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype,
                 attention: LlamaAttention, index: int) -> None:
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, comm, dtype,
                       activation="gelu_pytorch_tanh")
        super().__init__(config, comm, dtype, attention, mlp, norm=_norm)
        self.index = index
        self.pre_feedforward_layernorm = _norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = _norm(config.hidden_size, config.rms_norm_eps, dtype)

    def operations(self) -> list:
        return [self.qkv_op, self.attend_op, self.attention_output_op, YIELD, self.mlp_op,
                YIELD, self.mlp_output_op]

    def qkv_op(self, state: State, batch: ForwardBatch) -> None:
        residual = state.take("residual")
        if self.index == 0:  # the embedding's sum starts the stream
            residual = self.comm.wait_sum(state.take("partial"), residual)
        state.put("residual", residual)
        state.put("qkv", self.self_attn.project(self.input_layernorm(residual),
                                                batch.positions))

    def mlp_op(self, state: State, batch: ForwardBatch) -> None:
        attended = self.comm.wait_sum(state.take("partial"))
        residual = state.take("residual") + self.post_attention_layernorm(attended)
        state.put("residual", residual)
        state.put("partial", self.comm.all_reduce_async(
            self.mlp(self.pre_feedforward_layernorm(residual))))

    def mlp_output_op(self, state: State, batch: ForwardBatch) -> None:
        out = self.comm.wait_sum(state.take("partial"))
        state.put("residual", state.take("residual") + self.post_feedforward_layernorm(out))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text decoder (the `Gemma3ForCausalLM` checkpoints: 1B, and the text part of
    larger ones saved as such)."""

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        cfg = config.extra
        kinds = gemma_layer_types(config)
        rotaries = {kind: gemma_rotary(config, kind) for kind in set(kinds)}
        scale = cfg.get("query_pre_attn_scalar", config.head_dim) ** -0.5
        bias = bool(cfg.get("attention_bias", False))

        def layer(i: int) -> Gemma3DecoderLayer:
            attention = LlamaAttention(
                config, comm, rotaries[kinds[i]], dtype, qkv_bias=bias, o_bias=bias,
                head_norm=lambda d: _norm(d, config.rms_norm_eps, dtype), scale=scale,
                window=cfg.get("sliding_window") if kinds[i] == SLIDING else None)
            return Gemma3DecoderLayer(config, comm, dtype, attention, i)

        super(LlamaForCausalLM, self).__init__(config, DecoderModel(
            config, comm, dtype, layer, norm=_norm, embed_scale=config.hidden_size ** 0.5))

    def final_residual(self, state: State) -> torch.Tensor:
        return state.take("residual")
