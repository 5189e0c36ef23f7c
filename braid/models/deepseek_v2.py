"""DeepSeek-V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`), tensor parallel.

- Multi-head latent attention (braid.layers.mla): heads split over ranks, the latent KV
  cache replicated. The two projections every rank needs in full, `q_a_proj` (when the
  config has `q_lora_rank`) and `kv_a_proj_with_mqa`, are one fused `DataParallelLinear`: a
  replicated GEMM, or with `--dp-linear` one over 1/tp of the tokens plus an all-gather.
- MoE layers (braid.layers.moe) after the first `first_k_dense_replace` dense ones: routed
  experts split along their intermediate dimension, shared experts like a dense MLP, one
  all-reduce for both.

Operations per layer: `norm, fused A projection (launch its all-gather) | YIELD | attention,
launch all-reduce | YIELD | MLP or MoE, launch all-reduce | YIELD`, so two-batch overlap hides
the DP linear's all-gather as well as the all-reduces.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from braid.distributed.comm import Communicator, Pending
from braid.errors import UserError
from braid.layers.forward_batch import ForwardBatch
from braid.layers.linear import ColumnParallelLinear, DataParallelLinear, RowParallelLinear
from braid.layers.mla import LatentAttention
from braid.layers.mlp import GATE_UP_STACKED, GatedMLP
from braid.layers.moe import RoutedExperts, RouterConfig, TopKRouter, expert_checkpoint_param
from braid.layers.norm import RMSNorm
from braid.layers.partition import split_range
from braid.layers.rotary import RotaryEmbedding, yarn_mscale
from braid.loader.model_config import ModelConfig, rope_kind
from braid.loader.weights import LazyWeight
from braid.models.common import CausalLM, DecoderLayer, DecoderModel
from braid.models.config_fields import (
    COMMON_IMPLEMENTED,
    COMMON_NO_EFFECT,
    COMMON_RULES,
    neutral,
    table,
)
from braid.models.deepseek_mtp import MultiTokenPredictor
from braid.models.spec import Architecture, RandomModel
from braid.overlap.operations import YIELD, State

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: the reference code's default


@dataclass(frozen=True)
class MLAConfig:
    """The attention dimensions of a DeepSeek config."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @staticmethod
    def from_hf(cfg: dict) -> MLAConfig:
        return MLAConfig(cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["qk_nope_head_dim"],
                         cfg["qk_rope_head_dim"], cfg["v_head_dim"])

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token: normalised KV latent and rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _is_v3(config: ModelConfig) -> bool:
    return config.architecture == "DeepseekV3ForCausalLM"


def softmax_scale(mla: MLAConfig, rope_scaling: dict | None) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2 when it applies."""
    scale = mla.qk_head_dim ** -0.5
    if rope_kind(rope_scaling) != "default" and rope_scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"]) ** 2
    return scale


class DeepseekV2Attention(nn.Module):
    """MLA with this rank's heads: `project_latent` (replicated or DP), then `forward`."""

    def __init__(self, config: ModelConfig, comm: Communicator, rotary: RotaryEmbedding,
                 dtype: torch.dtype) -> None:
        super().__init__()
        mla = self.mla = MLAConfig.from_hf(config.extra)
        heads = config.num_heads
        start, self.num_heads = split_range(heads, comm.world_size, comm.rank)
        qk, nope_v = mla.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
        hidden = config.hidden_size
        if mla.q_lora_rank:
            self.fused_qkv_a_proj = DataParallelLinear(
                hidden, [mla.q_lora_rank, mla.latent_dim], comm, shard_ids=["q_a", "kv_a"],
                dtype=dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, [heads * qk], comm,
                                                 shard_ranges=[(start * qk, self.num_heads * qk)],
                                                 dtype=dtype)
        else:
            self.fused_qkv_a_proj = DataParallelLinear(hidden, [mla.latent_dim], comm,
                                                       shard_ids=["kv_a"], dtype=dtype)
            self.q_proj = ColumnParallelLinear(hidden, [heads * qk], comm,
                                               shard_ranges=[(start * qk, self.num_heads * qk)],
                                               dtype=dtype)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, [heads * nope_v], comm,
            shard_ranges=[(start * nope_v, self.num_heads * nope_v)], dtype=dtype)
        self.kv_b_proj.packable = False  # LatentAttention reads its weight as a matrix
        self.o_proj = RowParallelLinear(
            heads * mla.v_head_dim, hidden, comm,
            in_range=(start * mla.v_head_dim, self.num_heads * mla.v_head_dim), reduce=False,
            dtype=dtype)
        self.rotary = rotary
        self.attn = LatentAttention(self.num_heads, mla.kv_lora_rank, mla.qk_nope_head_dim,
                                    mla.qk_rope_head_dim, mla.v_head_dim,
                                    softmax_scale(mla, config.rope_scaling))

    def project_latent(self, hidden: torch.Tensor, batch: ForwardBatch) -> Pending:
        """Start the fused A projection of every token: token-split with an all-gather in
        flight (`batch.dp_linear`), or computed here in full; `latent` finishes it."""
        if batch.dp_linear:
            return self.fused_qkv_a_proj.forward_async(hidden)
        return (self.fused_qkv_a_proj(hidden),)

    def latent(self, pending: Pending, batch: ForwardBatch) -> torch.Tensor:
        """The fused A projection `project_latent` started."""
        if batch.dp_linear:
            return self.fused_qkv_a_proj.wait(pending, batch.num_tokens)
        return pending[0]

    def forward(self, hidden: torch.Tensor, projected: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """This rank's partial output; the caller all-reduces it."""
        mla = self.mla
        if mla.q_lora_rank:
            q_a, kv_a = projected.split([mla.q_lora_rank, mla.latent_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            kv_a, q = projected, self.q_proj(hidden)
        q_nope, q_rope = q.view(-1, self.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        kv_latent, k_rope = kv_a.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        q_rope, k_rope = self.rotary(batch.positions, q_rope, k_rope[:, None])
        latent = torch.cat([self.kv_a_layernorm(kv_latent), k_rope[:, 0]], dim=-1)
        attended = self.attn(q_nope, q_rope, latent, self.kv_b_proj.weight, batch)
        return self.o_proj(attended)


class DeepseekV2MoE(nn.Module):
    """Router, routed experts and shared experts; returns this rank's partial output."""

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = config.extra
        router = RouterConfig.from_hf(cfg, v3=_is_v3(config))
        inter = cfg["moe_intermediate_size"]
        self.gate = TopKRouter(config.hidden_size, router)
        self.experts = RoutedExperts(router.num_experts, config.hidden_size, inter, comm, dtype)
        shared = cfg.get("n_shared_experts") or 0
        self.shared_experts = (GatedMLP(config.hidden_size, inter * shared, comm, dtype)
                               if shared else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The partial sum of routed and shared experts."""
        weights, ids = self.gate(hidden)
        routed = self.experts(hidden, weights, ids)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts(hidden)


class DeepseekV2DecoderLayer(DecoderLayer):
    """MLA and a dense MLP or MoE, as the three stages described in the module docstring."""

    def __init__(self, config: ModelConfig, comm: Communicator, rotary: RotaryEmbedding,
                 dtype: torch.dtype, index: int) -> None:
        dense = index < config.extra.get("first_k_dense_replace", 0)
        mlp = (GatedMLP(config.hidden_size, config.intermediate_size, comm, dtype) if dense
               else DeepseekV2MoE(config, comm, dtype))
        super().__init__(config, comm, dtype, DeepseekV2Attention(config, comm, rotary, dtype),
                         mlp)

    def operations(self) -> list:
        return [self.latent_op, YIELD, self.attention_op, YIELD, self.mlp_op, YIELD]

    def latent_op(self, state: State, batch: ForwardBatch) -> None:
        self.start_attention(self.attention_input(state), state, batch)

    def start_attention(self, hidden: torch.Tensor, state: State, batch: ForwardBatch) -> None:
        """Keep the attention's normed input and start its fused A projection."""
        state.put("hidden", hidden)
        state.put("projected", self.self_attn.project_latent(hidden, batch))

    def attention_op(self, state: State, batch: ForwardBatch) -> None:
        hidden = state.take("hidden")
        projected = self.self_attn.latent(state.take("projected"), batch)
        state.put("partial", self.comm.all_reduce_async(self.self_attn(hidden, projected, batch)))


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(CausalLM):
    """DeepSeek-V2/V3 with a vocabulary-parallel LM head; returns logits of requested tokens."""

    stacked_params = (
        ("fused_qkv_a_proj", "q_a_proj", "q_a"),
        ("fused_qkv_a_proj", "kv_a_proj_with_mqa", "kv_a"),
        *GATE_UP_STACKED,  # dense MLPs and shared experts
    )
    has_dp_linear = True

    @classmethod
    def check_config(cls, config: ModelConfig, tp: int) -> None:
        if config.extra.get("quantization_config"):
            raise UserError("quantized DeepSeek checkpoints (e.g. FP8) are not supported; "
                            "convert the weights to bf16 first")
        if config.extra.get("attention_bias"):
            raise UserError("DeepSeek checkpoints with attention_bias are not supported")
        if tp > config.num_heads:
            raise UserError(f"--tp {tp} exceeds the model's {config.num_heads} attention heads; "
                            f"use --tp of at most {config.num_heads}")
        RouterConfig.from_hf(config.extra, v3=_is_v3(config))

    @classmethod
    def num_mtp_layers(cls, config: ModelConfig) -> int:
        return (config.extra.get("num_nextn_predict_layers") or 0) if _is_v3(config) else 0

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        mla = MLAConfig.from_hf(config.extra)
        rotary = RotaryEmbedding(mla.qk_rope_head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling,
                                 interleaved=config.extra.get("rope_interleave", True))
        super().__init__(config, DecoderModel(
            config, comm, dtype, lambda i: DeepseekV2DecoderLayer(config, comm, rotary, dtype, i)))
        self.rotary, self.weights_dtype = rotary, dtype
        self.mtp: MultiTokenPredictor | None = None

    def attach_mtp(self) -> MultiTokenPredictor:
        """Add the checkpoint's first multi-token-prediction layer (before loading): its
        weights load, its cache is allocated, and the forward pass keeps the hidden states
        it reads."""
        config, comm = self.config, self.lm_head.comm
        layer = DeepseekV2DecoderLayer(config, comm, self.rotary, self.weights_dtype,
                                       config.num_layers)
        self.mtp = MultiTokenPredictor(config, comm, layer, self.model.embed_tokens,
                                       self.lm_head, self.weights_dtype)
        self.keeps_hidden = True
        return self.mtp

    def attention_layers(self) -> list[nn.Module]:
        layers = super().attention_layers()
        return layers if self.mtp is None else [*layers, self.mtp.layer.self_attn.attn]

    def checkpoint_parts(self, name: str,
                         weight: LazyWeight) -> Iterable[tuple[str, LazyWeight]]:
        """The first MTP layer's tensors under `mtp.` where it is attached (none for its
        copies of the embedding and the head)."""
        layer = _LAYER.match(name)
        if self.mtp is None or layer is None or int(layer.group(1)) != self.config.num_layers:
            return ((name, weight),)
        param = self.mtp.parameter_name(name[layer.end():])
        return () if param is None else ((f"mtp.{param}", weight),)

    def checkpoint_param(self, name: str) -> tuple[str, object] | None:
        """Per-expert checkpoint tensors go into the stacked expert parameters."""
        return expert_checkpoint_param(name)

    def is_ignored_weight(self, name: str) -> bool:
        """Also the layers past `num_hidden_layers` (V3's multi-token-prediction module) that
        are not attached."""
        layer = _LAYER.match(name)
        return super().is_ignored_weight(name) or (
            layer is not None and int(layer.group(1)) >= self.config.num_layers)


# The family's spec (braid.models.spec).

# The config fields, with the keys of the original remote-code configs transformers' classes do
# not define.
_FIELDS = table(
    tuple(f for f in COMMON_IMPLEMENTED if f != "head_dim") + (
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "first_k_dense_replace", "moe_intermediate_size", "n_routed_experts",
        "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "topk_method",
        "scoring_func", "norm_topk_prob", "routed_scaling_factor", "rope_interleave"),
    COMMON_NO_EFFECT + (
        # transformers derives both from the rotary and nope dims and overwrites them
        "head_dim", "qk_head_dim",
        "pretraining_tp", "output_router_logits",
        # the remote code's training losses and its expert-parallel layout
        "aux_loss_alpha", "seq_aux", "ep_size",
        # V3's multi-token-prediction layers: read by `--speculative mtp` (`num_mtp_layers`);
        # without it braid skips their weights
        "num_nextn_predict_layers"),
    **COMMON_RULES,
    mlp_bias=neutral(False, None), attention_bias=neutral(False, None),
    # The remote code makes a layer MoE when layer % moe_layer_freq == 0 (past the first
    # dense ones); braid makes every such layer MoE.
    moe_layer_freq=neutral(1, None))

# The random checkpoints' shapes, V2's and V3's alike.
_RANDOM_SHAPES = {
    # Small and deliberately uneven (5 heads, 52 expert columns) so every TP split is tested.
    "tiny": dict(hidden_size=100, intermediate_size=160, moe_intermediate_size=52,
                 num_hidden_layers=3, num_attention_heads=5, kv_lora_rank=32,
                 qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=20, n_routed_experts=8,
                 first_k_dense_replace=1),
    # DeepSeek-V2-Lite-like widths with the bench dimensions.
    "bench": dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                  num_hidden_layers=4, num_attention_heads=16, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  n_routed_experts=16, first_k_dense_replace=1, q_lora_rank=1536,
                  num_experts_per_tok=4, n_shared_experts=1),
}


def _random_presets(router: dict, yarn: dict) -> dict[str, dict]:
    """The shapes with a version's router and YaRN rotary; the shapes override the router's
    widths (the bench preset's q LoRA, experts per token, shared experts)."""
    return {name: {**router, **shapes, "num_key_value_heads": shapes["num_attention_heads"],
                   "rope_scaling": yarn}
            for name, shapes in _RANDOM_SHAPES.items()}


FAMILY = (
    Architecture(
        "DeepseekV2ForCausalLM", DeepseekV2ForCausalLM, model_type="deepseek_v2",
        hf_config_class="DeepseekV2Config", fields=_FIELDS,
        random=RandomModel("deepseek_v2", transformers=False, presets=_random_presets(
            # Softmax scores; the tiny model uses group-limited greedy (the greedy path has a
            # unit test of its own) and no q LoRA, like V2-Lite.
            dict(scoring_func="softmax", topk_method="group_limited_greedy", n_group=4,
                 topk_group=2, num_experts_per_tok=2, n_shared_experts=2, norm_topk_prob=False,
                 routed_scaling_factor=1.5, q_lora_rank=None),
            dict(type="yarn", factor=4.0, original_max_position_embeddings=512, beta_fast=32,
                 beta_slow=1, mscale=0.707, mscale_all_dim=0.707)))),
    Architecture(
        "DeepseekV3ForCausalLM", DeepseekV2ForCausalLM, model_type="deepseek_v3",
        hf_config_class="DeepseekV3Config", fields=_FIELDS,
        random=RandomModel("deepseek_v3", transformers=False, presets=_random_presets(
            # Sigmoid scores, correction bias, groups ranked by their two best experts.
            dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                 num_experts_per_tok=3, n_shared_experts=1, norm_topk_prob=True,
                 routed_scaling_factor=2.5, q_lora_rank=48, rope_interleave=True,
                 num_nextn_predict_layers=1),
            # mscale != mscale_all_dim: the cos/sin magnitude correction is not 1 either.
            dict(type="yarn", factor=4.0, original_max_position_embeddings=512, beta_fast=32,
                 beta_slow=1, mscale=1.0, mscale_all_dim=0.8)))),
)
