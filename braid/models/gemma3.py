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
from braid.models.config_fields import (
    COMMON_IMPLEMENTED,
    COMMON_NO_EFFECT,
    LAYER_TYPES_RULE,
    ROPE,
    neutral,
    one_of,
    table,
)
from braid.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from braid.models.spec import (
    BENCH,
    TINY,
    TINY_WINDOW,
    Architecture,
    GGUFFile,
    GGUFMapping,
    RandomModel,
)
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


# The family's spec (braid.models.spec).

def _gemma3_gguf_config(cfg: dict, file: GGUFFile) -> None:
    """Gemma 3 as llama.cpp runs it (`llama_load_hparams_gemma3` / `case LLM_ARCH_GEMMA3` in
    src/llama-model.cpp): with a sliding window every sixth layer global unless the file gives
    a pattern, local layers at rotary base 10000 unless it gives one, and the softmax scale of
    1/sqrt(head_dim), of 1/sqrt(hidden / heads) for the 62-layer (27B) model, unless it gives
    `attention.scale`."""
    from gguf import Keys  # the gguf package only where a GGUF file is read (spec.GGUFMapping)

    get, layers = file.get, cfg["num_hidden_layers"]
    window = get(Keys.Attention.SLIDING_WINDOW)
    pattern = get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if not window:
        sliding = [False] * layers
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        period = 6 if pattern is None else int(pattern)
        # llama_hparams::set_swa_pattern: layer il is local iff il % n < n - 1 (0: all local)
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    scale = get(Keys.Attention.SCALE)
    if scale:
        query_scalar = 1.0 / float(scale) ** 2
    elif layers == 62:
        query_scalar = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        query_scalar = cfg["head_dim"]
    full = cfg["rope_parameters"]
    local = {"rope_type": "default",
             "rope_theta": float(get(Keys.Rope.FREQ_BASE_SWA, 10000.0))}
    del cfg["hidden_act"]
    cfg.update(
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={SLIDING: local, FULL: full},
        query_pre_attn_scalar=query_scalar,
        sliding_window=int(window) if window else None,
        layer_types=[SLIDING if s else FULL for s in sliding],
        final_logit_softcapping=get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
        attn_logit_softcapping=get(Keys.LLM.ATTN_LOGIT_SOFTCAPPING),
        attention_bias=False,
        use_bidirectional_attention=False,
    )


# Gemma has no system role: its text opens the first user turn. The assistant is "model".
_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' "
    "else '' %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{{- '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else message['role']) "
    "~ '\\n' ~ (system ~ '\\n\\n' if system and loop.first else '') ~ "
    "(message['content'] or '') ~ '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

FAMILY = (
    Architecture(
        "Gemma3ForCausalLM", Gemma3ForCausalLM, model_type="gemma3_text",
        hf_config_class="Gemma3TextConfig",
        fields=table(
            COMMON_IMPLEMENTED + (
                "attention_bias", "query_pre_attn_scalar", "sliding_window",
                # layer kinds from a pattern (older configs, and transformers' private copy)
                "sliding_window_pattern", "_sliding_window_pattern",
                # the local layers' rotary base in configs before transformers 5
                "rope_local_base_freq"),
            COMMON_NO_EFFECT + (
                # a generation-time cache choice
                "cache_implementation",
                # not read by transformers' Gemma 3 (hidden_activation is)
                "hidden_act"),
            rope_parameters=ROPE, rope_scaling=ROPE, layer_types=LAYER_TYPES_RULE,
            # GeGLU with tanh
            hidden_activation=one_of(frozenset({"gelu_pytorch_tanh"})),
            attn_logit_softcapping=neutral(None), final_logit_softcapping=neutral(None),
            use_bidirectional_attention=neutral(False, None)),
        # The norms compute `x * (1 + w)`, llama.cpp's `x * w`: the converter stored `w + 1`.
        gguf=GGUFMapping("gemma3", _gemma3_gguf_config, norm_offset=1.0),
        # Local (windowed) and global layers, each kind with its own rotary base; a softmax
        # scale from query_pre_attn_scalar != head_dim. tiny: [local, global, local] (the
        # pattern of 2 and the explicit list agree), embeddings untied: tied, the input
        # embedding (scaled up by sqrt(hidden)) stays large in so shallow a residual stream,
        # and the tied head then picks the input token again at most positions. bench:
        # Gemma-3-1B's widths, tied, the last of its 4 layers global.
        random=RandomModel(
            "gemma3", chat_template=_CHAT_TEMPLATE, norm_center=0.0, scaled_embedding=True,
            presets={
                "tiny": dict(**TINY, head_dim=16, num_hidden_layers=3,
                             sliding_window=TINY_WINDOW, tie_word_embeddings=False,
                             sliding_window_pattern=2, layer_types=[SLIDING, FULL, SLIDING],
                             query_pre_attn_scalar=24, rope_parameters={
                                 SLIDING: dict(rope_type="default", rope_theta=10000.0),
                                 FULL: dict(rope_type="default", rope_theta=1e6)}),
                "bench": dict(**BENCH, hidden_size=1152, intermediate_size=6912,
                              num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=1, head_dim=256, sliding_window=512,
                              sliding_window_pattern=4, query_pre_attn_scalar=256,
                              rope_parameters={
                                  SLIDING: dict(rope_type="default", rope_theta=10000.0),
                                  FULL: dict(rope_type="default", rope_theta=1e6)}),
            })),
)
