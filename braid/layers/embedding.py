"""Vocabulary-parallel token embedding and LM head (the vocabulary split over ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.partition import split_range, split_sizes
from braid.layers.quant import Quantizable, int8_applies, linear
from braid.loader.weights import LazyWeight


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous range of vocabulary rows; lookups are summed over ranks."""

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
        rows = weight.narrow(0, self.start, self.size)
        if tuple(rows.shape) != tuple(param.shape):
            raise ValueError(f"embedding shard: expected {tuple(param.shape)}, "
                             f"got {tuple(rows.shape)}")
        param.data.copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(out)


class ParallelLMHead(nn.Module, Quantizable):
    """Logits over this rank's vocabulary range, gathered into the full vocabulary on rank 0
    (which samples); the other ranks get no rows.

    With tied embeddings the head reuses the embedding's weight (same vocabulary split).
    """

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        super().__init__()
        self.comm = embedding.comm
        self.vocab_sizes = embedding.vocab_sizes
        # At tp 1 the head's output is the logits, wanted row-major: a packed weight gives
        # them so (2.5 ms against 3.7 for the transposed product and its copy at 1 row, 3.6
        # against 9.1 at 32, weights cold). A tied head packs a copy of the embedding's rows.
        # Under tensor parallelism the gather wants [vocab, tokens], where weight @ hidden^T
        # on the row-major weight is faster from 8 rows on.
        self.packable = self.comm.world_size == 1
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
        # A compiled step (braid.engine.compiled_step) takes the linear form too: inductor
        # packs a linear's weight, not a plain product's.
        if (self.packed is not None or int8_applies(hidden, self.int8)
                or torch.compiler.is_compiling()):
            rows = linear(hidden, self.quantizable_weight(), int8=self.int8,
                          packed=self.packed, gemv=self.gemv)  # [tokens, vocab]
            if self.comm.world_size == 1:
                return rows
            local = rows.t()
        else:
            # weight @ hidden^T, i.e. [vocab, tokens]: for the few rows of a decode step MKL
            # runs this orientation about 1.5x faster than F.linear; it is the gather's layout.
            local = torch.mm(self.quantizable_weight(), hidden.t())
        if self.comm.world_size > 1:
            local = self.comm.gather_to_first(local, self.vocab_sizes)
            if local is None:
                return hidden.new_empty(0, sum(self.vocab_sizes))
        return local.t()
