"""What every decoder-only model shares: embedding, final norm, LM head, and the operations
that open and close the forward pass.

State between operations (see `braid.overlap.operations`): "partial" is the all-reduce in
flight (the embedding's, then each block's: a `Pending`), "residual" the running residual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from braid.layers.forward_batch import ForwardBatch
from braid.layers.norm import RMSNorm
from braid.loader.model_config import ModelConfig
from braid.loader.weights import LazyWeight
from braid.overlap.operations import State, between_pieces

# Builds a norm from (size, eps, dtype): `RMSNorm`, or Gemma's `OffsetRMSNorm`.
Norm = Callable[[int, float, torch.dtype], nn.Module]


class DecoderModel(nn.Module):
    """Embedding (times `embed_scale` where the model scales it: Gemma), decoder layers (built
    by `make_layer(index)`) and the final norm."""

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype,
                 make_layer: Callable[[int], nn.Module], norm: Norm = RMSNorm,
                 embed_scale: float | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm,
                                                   dtype)
        # rounded to the model's dtype, as transformers multiplies by it
        self.embed_scale = (None if embed_scale is None
                            else torch.tensor(embed_scale, dtype=dtype).item())
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps, dtype)

    def embed_op(self, state: State, batch: ForwardBatch) -> None:
        # A rank's partial holds the rows of its vocabulary slice and zeros: scaling it before
        # the sum is scaling the sum.
        partial = self.embed_tokens.partial(batch.input_ids)
        if self.embed_scale is not None:
            partial = partial * self.embed_scale
        state.put("partial", self.embed_tokens.comm.all_reduce_async(partial))
        state.put("residual", None)


class DecoderLayer(nn.Module):
    """A pre-norm block pair: `self_attn` and `mlp`, each behind an RMSNorm of the residual
    stream. Both return this rank's partial output; the layer all-reduces it and adds it to
    the residual as it arrives.
    Subclasses provide `operations()` with their attention operations; the MLP's is shared."""

    def __init__(self, config: ModelConfig, comm: Communicator, dtype: torch.dtype,
                 self_attn: nn.Module, mlp: nn.Module, norm: Norm = RMSNorm) -> None:
        super().__init__()
        self.comm = comm
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = mlp

    def operations(self) -> list:
        raise NotImplementedError

    def attention_input(self, state: State) -> torch.Tensor:
        """Wait for the previous block's sum, add it to the residual, normalise."""
        return self.input_layernorm(add_to_residual(self.comm, state))

    def mlp_op(self, state: State, batch: ForwardBatch) -> None:
        hidden = self.post_attention_layernorm(add_to_residual(self.comm, state))
        state.put("partial", self.comm.all_reduce_async(self.mlp(hidden)))


def add_to_residual(comm: Communicator, state: State) -> torch.Tensor:
    """The new residual: the block sum in flight ("partial") plus the running residual (none
    before the first block), summed straight from the communicator's buffers."""
    residual = comm.wait_sum(state.take("partial"), state.take("residual"))
    state.put("residual", residual)
    return residual


class CausalLM(nn.Module):
    """A `DecoderModel` under a vocabulary-parallel LM head; the forward pass is one operation
    list whose output is "logits" (of the requested tokens). Subclasses build `self.model`
    with layers that expose `operations()` and `self_attn.attn` (their cache owner)."""

    stacked_params: tuple = ()
    # Whether the model has replicated projections that `--dp-linear` splits over tokens.
    has_dp_linear: bool = False
    # Whether the forward pass also outputs "hidden": every row's final hidden states (after
    # the final norm), for a draft layer that reads them (`--speculative mtp`)
    keeps_hidden: bool = False

    @classmethod
    def num_mtp_layers(cls, config: ModelConfig) -> int:
        """The checkpoint's multi-token-prediction layers (`--speculative mtp`)."""
        return 0

    @classmethod
    def check_config(cls, config: ModelConfig, tp: int) -> None:
        """Raise `UserError` if this checkpoint cannot run at `tp` ranks (the driver calls it
        before launching, so the user gets one clear line instead of a rank's traceback)."""

    @classmethod
    def describe_split(cls, config: ModelConfig, tp: int) -> str:
        """How `tp` ranks divide the model, one line for the start-up message ("" if
        nothing to say)."""
        return ""

    def __init__(self, config: ModelConfig, model: DecoderModel) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(model.embed_tokens, config.tie_word_embeddings)

    def is_ignored_weight(self, name: str) -> bool:
        """A checkpoint tensor present but unused: a tied head stored anyway."""
        return self.config.tie_word_embeddings and name == "lm_head.weight"

    def checkpoint_parts(self, name: str,
                         weight: LazyWeight) -> Iterable[tuple[str, LazyWeight]]:
        """A checkpoint tensor as the tensors the loader maps: itself, unless the checkpoint
        fused several that braid keeps apart or splits otherwise (Phi-3's `qkv_proj`)."""
        return ((name, weight),)

    def checkpoint_param(self, name: str) -> tuple[str, object] | None:
        """(parameter name, shard id) for checkpoint names `stacked_params` cannot map; None
        leaves a name to that rule."""
        return None

    def attention_layers(self) -> list[nn.Module]:
        """The modules that own a KV cache (`allocate_cache`), one per layer."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def operations(self) -> list:
        ops = [self.model.embed_op]
        for layer in self.model.layers:
            ops += layer.operations()
        return [*ops, self.logits_op]

    def final_residual(self, state: State) -> torch.Tensor:
        """The residual stream after the last layer: its running value plus the last block's
        sum in flight."""
        return self.lm_head.comm.wait_sum(state.take("partial"), state.take("residual"))

    @between_pieces  # the rows it keeps vary by step (a prompt chunk keeps none)
    def logits_op(self, state: State, batch: ForwardBatch) -> None:
        hidden = self.model.norm(self.final_residual(state))
        if self.keeps_hidden:
            state.put("hidden", hidden)
        if batch.pool_tokens is not None:  # embeddings: the sum of each pool segment, fp32
            pooled = hidden.new_zeros(batch.num_pools, hidden.shape[1], dtype=torch.float32)
            state.put("pooled", pooled.index_add_(0, batch.pool_ids,
                                                  hidden[batch.pool_tokens].float()))
        state.put("logits", logit_rows(self.lm_head, hidden, batch))


def logit_rows(head: ParallelLMHead, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """The head's logits of the batch's logit rows of `hidden` (on rank 0; see
    `ParallelLMHead`), row-major."""
    if batch.logits_index is not None:
        hidden = hidden[batch.logits_index]
    if hidden.shape[0] == 0:  # no logits wanted (a prompt chunk): every rank skips the head
        return hidden.new_empty(0, sum(head.vocab_sizes), dtype=torch.float32)
    # Row-major: sampling over a transposed layout (argmax, row selection) costs several
    # times the transpose.
    return head(hidden).contiguous()
