"""The gated MLP, tensor parallel: merged gate/up columns, down rows; SwiGLU, or GeGLU with
the tanh approximation (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.distributed.comm import Communicator
from braid.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from braid.layers.partition import split_range
from braid.layers.quant import swiglu

# Checkpoint names of the fused gate/up projection: (our segment, checkpoint segment, shard id),
# for a model's `stacked_params`.
GATE_UP_STACKED = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


# Gate activations: transformers' names (`hidden_act`) of those braid computes.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`, `act` SiLU or tanh-approximated GELU (`ACTIVATIONS`);
    returns this rank's partial sum (the caller all-reduces)."""

    def __init__(self, hidden_size: int, intermediate_size: int, comm: Communicator,
                 dtype: torch.dtype, activation: str = "silu") -> None:
        super().__init__()
        assert activation in ACTIVATIONS, activation  # model classes check their configs
        self.activation = activation
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], comm, dtype=dtype)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, comm,
            in_range=split_range(intermediate_size, comm.world_size, comm.rank), reduce=False,
            dtype=dtype)
        # SwiGLU's halves are packed apart, for the activation in the GEMM's epilogue
        self.gate_up_proj.gated = activation == "silu"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return self.down_proj(swiglu(self.gate_up_proj, hidden))
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
