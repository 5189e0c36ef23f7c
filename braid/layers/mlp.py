"""The SwiGLU MLP, tensor parallel: merged gate/up columns, down rows."""

from __future__ import annotations

import torch
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from braid.layers.partition import split_range
from braid.layers.quant import swiglu

# Checkpoint names of the fused gate/up projection: (our segment, checkpoint segment, shard id),
# for a model's `stacked_params`.
GATE_UP_STACKED = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`; returns this rank's partial sum (the caller all-reduces)."""

    def __init__(self, hidden_size: int, intermediate_size: int, comm: Communicator,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], comm, dtype=dtype)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, comm,
            in_range=split_range(intermediate_size, comm.world_size, comm.rank), reduce=False,
            dtype=dtype)
        self.gate_up_proj.gated = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj, hidden))
