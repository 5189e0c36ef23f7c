"""Llama-architecture decoder (Llama 2/3, SmolLM, Mistral-style GQA) with tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.config import ModelConfig
from braid.distributed.comm import Communicator, Handle
from braid.engine.batch import ForwardBatch
from braid.layers.attention import PagedAttention
from braid.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from braid.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from braid.layers.norm import RMSNorm
from braid.layers.partition import partition_heads, split_range
from braid.layers.rotary import RotaryEmbedding
from braid.overlap.operations import YIELD, State


class LlamaAttention(nn.Module):
    """QKV projection, rotary, paged attention and the row-parallel output projection."""

    def __init__(self, config: ModelConfig, comm: Communicator, rotary: RotaryEmbedding,
                 dtype: torch.dtype) -> None:
        super().__init__()
        heads = partition_heads(config.num_heads, config.num_kv_heads, comm.world_size)[comm.rank]
        d = config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_count, heads.kv_count, d
        bias = bool(config.extra.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, heads, comm, bias=bias,
                                          dtype=dtype)
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, comm,
                                        in_range=(heads.q_start * d, heads.q_count * d),
                                        reduce=False, dtype=dtype)
        self.rotary = rotary
        self.attn = PagedAttention(heads.q_count, heads.kv_count, d)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """This rank's partial output; the caller all-reduces it."""
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(batch.positions, q, k)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), batch)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """SwiGLU MLP: merged gate/up (column parallel), down (row parallel)."""

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], comm,
                                                       dtype=dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, comm,
                                           in_range=split_range(inter, comm.world_size, comm.rank),
                                           reduce=False, dtype=dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's partial output; the caller all-reduces it."""
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals (the add is fused into the next norm).

    As operations: `attention -> launch all-reduce | YIELD | wait, MLP -> launch all-reduce |
    YIELD`; the wait of the second all-reduce opens the next layer. State keys: "partial" (the
    handle of the all-reduce in flight) and "residual".
    """

    def __init__(self, config: ModelConfig, comm: Communicator, rotary: RotaryEmbedding,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.comm = comm
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, comm, rotary, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, comm, dtype)

    def operations(self) -> list:
        return [self.attention_op, YIELD, self.mlp_op, YIELD]

    def attention_op(self, state: State, batch: ForwardBatch) -> None:
        hidden, residual = self.input_layernorm(state.take("partial").wait(),
                                                state.take("residual"))
        state.put("residual", residual)
        state.put("partial", self.comm.all_reduce_async(self.self_attn(hidden, batch)))

    def mlp_op(self, state: State, batch: ForwardBatch) -> None:
        hidden, residual = self.post_attention_layernorm(state.take("partial").wait(),
                                                         state.take("residual"))
        state.put("residual", residual)
        state.put("partial", self.comm.all_reduce_async(self.mlp(hidden)))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm,
                                                   dtype)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, comm, rotary, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def embed_op(self, state: State, batch: ForwardBatch) -> None:
        state.put("partial", Handle(lambda: self.embed_tokens(batch.input_ids)))
        state.put("residual", None)


class LlamaForCausalLM(nn.Module):
    """Llama with a vocabulary-parallel LM head; returns logits of the requested tokens."""

    # Checkpoint tensors fused into one parameter: (our segment, checkpoint segment, shard id).
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, comm, dtype)
        self.lm_head = ParallelLMHead(self.model.embed_tokens, config.tie_word_embeddings)

    def ignored_weights(self) -> tuple[str, ...]:
        """Checkpoint names that are present but unused (a tied head stored anyway)."""
        return ("lm_head.weight",) if self.config.tie_word_embeddings else ()

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def operations(self) -> list:
        """The whole forward pass as one list of operations; the output is "logits"."""
        ops = [self.model.embed_op]
        for layer in self.model.layers:
            ops += layer.operations()
        return [*ops, self.logits_op]

    def logits_op(self, state: State, batch: ForwardBatch) -> None:
        hidden = self.model.norm(state.take("partial").wait(), state.take("residual"))[0]
        if batch.logits_index is not None:
            hidden = hidden[batch.logits_index]
        state.put("logits", self.lm_head(hidden).float())
