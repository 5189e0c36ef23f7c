"""Llama-architecture decoder (Llama 2/3, SmolLM) with tensor parallelism, and the options the
families built on it add (`braid.models.qwen`, `mistral`, `phi3`, `gemma3`): biases on the
projections, RMSNorm on each query and key head, a sliding window per layer, a MoE in place of
the MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.attention import PagedAttention
from braid.layers.forward_batch import ForwardBatch
from braid.layers.linear import QKVParallelLinear, RowParallelLinear
from braid.layers.mlp import GATE_UP_STACKED, GatedMLP
from braid.layers.norm import RMSNorm
from braid.layers.partition import partition_heads, split_sizes
from braid.layers.rotary import RotaryEmbedding
from braid.loader.model_config import ModelConfig
from braid.models.common import CausalLM, DecoderLayer, DecoderModel
from braid.models.config_fields import (
    COMMON_IMPLEMENTED,
    COMMON_NO_EFFECT,
    COMMON_RULES,
    neutral,
    table,
)
from braid.models.spec import Architecture, GGUFFile, GGUFMapping, RandomModel
from braid.overlap.operations import YIELD, State, between_pieces

# Builds the per-head norm of queries or keys (Qwen3, Gemma 3) from the head dim.
HeadNorm = Callable[[int], nn.Module]


class LlamaAttention(nn.Module):
    """QKV projection, rotary, paged attention and the row-parallel output projection."""

    def __init__(self, config: ModelConfig, comm: Communicator, rotary: RotaryEmbedding,
                 dtype: torch.dtype, *, window: int | None = None, qkv_bias: bool = False,
                 o_bias: bool = False, head_norm: HeadNorm | None = None,
                 scale: float | None = None) -> None:
        """`window`: the layer's sliding window (None: it sees every key); `qkv_bias`,
        `o_bias`: biases on the Q/K/V and output projections; `head_norm`: builds the norms
        each query and key head goes through before the rotary (`q_norm`, `k_norm`);
        `scale`: the softmax scale where it is not head_dim ** -0.5."""
        super().__init__()
        heads = partition_heads(config.num_heads, config.num_kv_heads, comm.world_size)[comm.rank]
        d = config.head_dim
        held_start, held = heads.held
        self.num_heads, self.num_kv_heads, self.head_dim = held, heads.kv_count, d
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, heads, comm, bias=qkv_bias,
                                          dtype=dtype)
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, comm,
                                        in_range=(held_start * d, held * d),
                                        reduce=False, bias=o_bias, dtype=dtype)
        self.q_norm = head_norm(d) if head_norm else None
        self.k_norm = head_norm(d) if head_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(held, heads.kv_count, d, heads.runs(), window=window,
                                   scale=scale, kv_parts=heads.kv_parts,
                                   own_offset=heads.own_offset)

    def project(self, hidden: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of this rank's heads, rotated: [T, heads, d], [T, kv, d]
        and [T, kv, d]."""
        qkv = self.qkv_proj(hidden)
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = qkv.split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
        qk = qk.view(-1, heads + kv_heads, d)
        if self.q_norm is not None:
            q, k = qk.split([heads, kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q.reshape(-1, d)).view(q.shape),
                            self.k_norm(k.reshape(-1, d)).view(k.shape)], dim=1)
        q, k = self.rotary.rotate(positions, qk).split([heads, kv_heads], dim=1)
        return q, k, v.view(-1, kv_heads, d)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """This rank's partial output; the caller all-reduces it."""
        return self.o_proj(self.attn(*self.project(hidden, batch.positions), batch))


class LlamaDecoderLayer(DecoderLayer):
    """As operations: `wait, norm, qkv, rotary | attention | o_proj -> launch all-reduce | YIELD |
    wait, MLP -> launch all-reduce | YIELD`; the wait of the second all-reduce opens the next
    layer. Attention is an operation of its own: it reads the step's per-sequence metadata, so
    compiled pieces of a step end before it (`between_pieces`)."""

    def operations(self) -> list:
        return [self.qkv_op, self.attend_op, self.attention_output_op, YIELD, self.mlp_op, YIELD]

    def qkv_op(self, state: State, batch: ForwardBatch) -> None:
        state.put("qkv", self.self_attn.project(self.attention_input(state), batch.positions))

    @between_pieces
    def attend_op(self, state: State, batch: ForwardBatch) -> None:
        state.put("attended", self.self_attn.attn(*state.take("qkv"), batch))

    def attention_output_op(self, state: State, batch: ForwardBatch) -> None:
        state.put("partial", self.comm.all_reduce_async(
            self.self_attn.o_proj(state.take("attended"))))


def _span(start: int, count: int) -> str:
    return str(start) if count == 1 else f"{start}-{start + count - 1}"


class LlamaForCausalLM(CausalLM):
    """Llama with a vocabulary-parallel LM head; returns logits of the requested tokens.

    The families built on it override the class methods that say how a layer differs:
    `attention_options` (biases, head norms, window), `make_mlp` and `make_rotary`."""

    # Checkpoint tensors fused into one parameter: (our segment, checkpoint segment, shard id).
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        *GATE_UP_STACKED,
    )

    @classmethod
    def check_config(cls, config: ModelConfig, tp: int) -> None:
        partition_heads(config.num_heads, config.num_kv_heads, tp)

    @classmethod
    def describe_split(cls, config: ModelConfig, tp: int) -> str:
        ranks = []
        for rank, s in enumerate(partition_heads(config.num_heads, config.num_kv_heads, tp)):
            shared = [str(s.kv_start + j) for j, (_, parts) in enumerate(s.kv_parts) if parts > 1]
            held = (f"; KV {', '.join(shared)} split over sequences at decode, query heads "
                    f"{_span(*s.held)} held" if shared else "")
            ranks.append(f"rank {rank}: query heads {_span(s.q_start, s.q_count)} "
                         f"(KV {_span(s.kv_start, s.kv_count)}{held})")
        sizes = lambda total: "/".join(map(str, split_sizes(total, tp)))  # noqa: E731
        return (f"{'; '.join(ranks)}; MLP columns {sizes(config.intermediate_size)}; "
                f"vocabulary rows {sizes(config.vocab_size)}")

    @classmethod
    def attention_options(cls, config: ModelConfig, index: int, dtype: torch.dtype) -> dict:
        """`LlamaAttention`'s keyword options for layer `index`: Llama's `attention_bias`
        puts a bias on all four projections, as transformers does."""
        bias = bool(config.extra.get("attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias)

    @classmethod
    def make_mlp(cls, config: ModelConfig, comm: Communicator, dtype: torch.dtype,
                 index: int) -> nn.Module:
        """Layer `index`'s MLP (a MoE in the sparse families), returning a partial sum."""
        return GatedMLP(config.hidden_size, config.intermediate_size, comm, dtype)

    @classmethod
    def make_rotary(cls, config: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                               config.rope_theta, config.rope_scaling)

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        rotary = self.make_rotary(config)

        def layer(i: int) -> LlamaDecoderLayer:
            attention = LlamaAttention(config, comm, rotary, dtype,
                                       **self.attention_options(config, i, dtype))
            return LlamaDecoderLayer(config, comm, dtype, attention,
                                     self.make_mlp(config, comm, dtype, i))

        super().__init__(config, DecoderModel(config, comm, dtype, layer))


def per_head_rms_norm(config: ModelConfig, dtype: torch.dtype) -> HeadNorm:
    """Qwen3's `q_norm` / `k_norm`: an RMSNorm over each head's dims."""
    return lambda head_dim: RMSNorm(head_dim, config.rms_norm_eps, dtype)


# The family's spec (braid.models.spec).

def llama_gguf_config(cfg: dict, file: GGUFFile) -> None:
    """Llama's biases, which llama.cpp writes no key for: the file has the tensors or not."""
    cfg.update(attention_bias="blk.0.attn_q.bias" in file.shapes,
               mlp_bias="blk.0.ffn_up.bias" in file.shapes)


# What Llama 3's configs share: the vocabulary and the rotary base
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)

FAMILY = (
    Architecture(
        "LlamaForCausalLM", LlamaForCausalLM, model_type="llama", hf_config_class="LlamaConfig",
        fields=table(
            COMMON_IMPLEMENTED + ("attention_bias",), COMMON_NO_EFFECT + (
                # transformers 4 split the MLP GEMMs into this many slices and summed them:
                # the same product; transformers 5 no longer reads it.
                "pretraining_tp",),
            **COMMON_RULES, mlp_bias=neutral(False, None)),
        # Without experts: a `llama` file with experts is Mixtral's (braid.models.mistral).
        gguf=GGUFMapping("llama", llama_gguf_config, experts=False, rotary_permuted=True),
        random=RandomModel("llama", transformers=False, presets={
            # SmolLM2's heads (9 query, 3 KV: tp 2 splits a KV head's group) at head dim 16,
            # the smallest the decode operator takes.
            "tiny": dict(hidden_size=144, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3),
            "bench": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                          num_attention_heads=16, num_key_value_heads=4),
            # The shapes of Meta's Llama 3 models people run on CPUs (their vocabulary too;
            # ids past the embedded tokenizer's are never produced by its prompts)
            "1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
            "3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                       num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True),
            "8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
        })),
)
