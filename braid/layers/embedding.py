"""Vocabulary-parallel token embedding and LM head (the vocabulary split over ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.ggml_weight import GGMLWeight
from braid.layers.linear import load_rows
from braid.layers.partition import split_range, split_sizes
from braid.layers.quant import Quantizable
from braid.loader.weights import LazyWeight


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous range of vocabulary rows; lookups are summed over ranks.
    Rows in a GGUF file's quantized blocks stay so (`ggml`), and a lookup decodes its rows."""

    ggml: GGMLWeight | None = None

    def __init__(self, vocab_size: int, hidden_size: int, comm: Communicator,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_sizes = split_sizes(vocab_size, comm.world_size)
        self.start, self.size = split_range(vocab_size, comm.world_size, comm.rank)
        self.weight = nn.Parameter(torch.empty(self.size, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, weight: LazyWeight, shard_id: object = None) -> None:
        load_rows(param, 0, weight, 0, self.start, self.size, "embedding shard")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.partial(input_ids))

    def partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the lookup, zero for the tokens outside its range (the sum over
        ranks is the embedding)."""
        if self.comm.world_size == 1:
            return self._rows(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.size)
        out = self._rows(local.masked_fill(outside, 0))
        return out.masked_fill_(outside.unsqueeze(-1), 0)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ggml is not None:
            return self.ggml.lookup(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)


class ParallelLMHead(nn.Module, Quantizable):
    """Logits over this rank's vocabulary range, gathered into the full vocabulary on rank 0
    (which samples) as `[tokens, vocab]` float32; the other ranks get no rows.

    With tied embeddings the head reuses the embedding's weight (same vocabulary split), and
    its packed copy (`quant.make_weight_forms`) packs the embedding's rows.
    """

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        super().__init__()
        self.comm = embedding.comm
        self.vocab_sizes = embedding.vocab_sizes
        if tied:
            self.tied_embedding = [embedding]  # a list, so the parameter is not registered twice
            self.weight = None
        else:
            self.tied_embedding = []
            self.weight = nn.Parameter(torch.empty_like(embedding.weight), requires_grad=False)
            self.weight.weight_loader = embedding.load_shard

    def quantizable_weight(self) -> torch.Tensor:
        return self.tied_embedding[0].weight if self.tied_embedding else self.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self._local_logits(hidden)
        if self.comm.world_size == 1:
            return local.float()
        return self._gather_columns(local)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, this rank's vocabulary], contiguous or a transposed view."""
        # The few-row kernel and the packed weight are the fastest forms
        # (docs/kernel-choices.md). A compiled step (braid.worker.compiled_step) takes the
        # linear form too: inductor packs a linear's weight, not a plain product's.
        if (self.few_rows or self.packed is not None or self.ggml is not None
                or torch.compiler.is_compiling()):
            return self.apply_linear(hidden)
        # Neither (fp32, or unpacked bf16 without the few-row kernel): weight @ hidden^T,
        # which MKL runs faster than F.linear for the few rows of a decode step.
        return torch.mm(self.quantizable_weight(), hidden.t()).t()

    def _gather_columns(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's `[tokens, part]` logits placed side by side on rank 0, as float32;
        an empty tensor on the others. Each rank sends its part in its memory order (every
        rank takes the same path, so the orders agree), and rank 0 places each part as one
        strided copy that also converts it."""
        tokens, vocab = local.shape[0], sum(self.vocab_sizes)
        transposed = not local.is_contiguous()
        flat = (local.t() if transposed else local).reshape(-1)
        numels = [tokens * size for size in self.vocab_sizes]
        gathered = self.comm.gather_to_first(flat, numels)
        if gathered is None:
            return local.new_empty(0, vocab, dtype=torch.float32)
        out = torch.empty(tokens, vocab, dtype=torch.float32, device=local.device)
        parts = gathered.split(numels)
        columns = out.split(self.vocab_sizes, dim=1)
        for size, part, column in zip(self.vocab_sizes, parts, columns):
            column.copy_(part.view(size, tokens).t() if transposed else part.view(tokens, size))
        return out
