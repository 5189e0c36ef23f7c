"""DeepSeek-V3's multi-token-prediction (MTP) layer, the draft of `--speculative mtp`.

The checkpoint's layer `num_hidden_layers` (V3 has `num_nextn_predict_layers` = 1) predicts
the token after next. At a position p it combines the model's final hidden state there (after
the final norm, as vLLM and SGLang feed it) with the embedding of the token at p + 1,

    residual = eh_proj(cat(enorm(embed(token[p + 1])), hnorm(hidden[p])))

runs one more decoder layer over it (MLA and MoE, split over the ranks like the model's own,
with a latent KV cache of its own written at the model's slots for the same positions), and
scores the result through `shared_head.norm` and the LM head. DeepSeek-V3's file stores copies
of the embedding and the head under the layer (`embed_tokens`, `shared_head.head`); braid
computes with the model's own and skips the copies.

The ranks run it after each step's forward, over all the step's rows, so its cache holds
every position the model's does (`braid.worker.mtp`).
"""

from __future__ import annotations

import torch
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from braid.layers.forward_batch import ForwardBatch
from braid.layers.linear import ReplicatedLinear
from braid.layers.norm import RMSNorm
from braid.loader.model_config import ModelConfig
from braid.models.common import logit_rows
from braid.overlap.operations import YIELD, State

# The layer's checkpoint tensors that are copies of the model's own
SHARED_WITH_MODEL = ("embed_tokens.weight", "shared_head.head.weight")


class MultiTokenPredictor(nn.Module):
    """One MTP layer over the model's embedding and head (see the module docstring);
    `operations()` take the model's final hidden states as the state's "previous"."""

    def __init__(self, config: ModelConfig, comm: Communicator, layer: nn.Module,
                 embed: VocabParallelEmbedding, head: ParallelLMHead,
                 dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.comm = comm
        self.enorm = RMSNorm(h, eps, dtype)
        self.hnorm = RMSNorm(h, eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, dtype=dtype)
        self.layer = layer
        self.norm = RMSNorm(h, eps, dtype)  # the checkpoint's shared_head.norm
        self._model = (embed, head)  # a tuple: the model's modules, not registered again

    @staticmethod
    def parameter_name(name: str) -> str | None:
        """This module's parameter for a tensor of the checkpoint's MTP layer, named from the
        layer's prefix on (`self_attn.o_proj.weight`); None for the copies it skips."""
        if name in SHARED_WITH_MODEL:
            return None
        if name.startswith("shared_head.norm."):
            return "norm." + name.removeprefix("shared_head.norm.")
        if name.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            return name
        return "layer." + name

    def operations(self) -> list:
        layer = self.layer
        return [self.input_op, YIELD, layer.attention_op, YIELD, layer.mlp_op, YIELD,
                self.logits_op]

    def input_op(self, state: State, batch: ForwardBatch) -> None:
        """The layer's input from the model's hidden states and the next tokens (the batch's
        input ids), then its attention's input, as the decoder layer's `latent_op`."""
        embed, _ = self._model
        previous = state.take("previous")
        combined = torch.cat([self.enorm(embed(batch.input_ids)), self.hnorm(previous)], dim=-1)
        residual = self.eh_proj(combined)
        state.put("residual", residual)
        self.layer.start_attention(self.layer.input_layernorm(residual), state, batch)

    def logits_op(self, state: State, batch: ForwardBatch) -> None:
        """Logits of the batch's logit rows (gathered on rank 0, as the model's)."""
        _, head = self._model
        hidden = self.norm(self.comm.wait_sum(state.take("partial"), state.take("residual")))
        state.put("logits", logit_rows(head, hidden, batch))
