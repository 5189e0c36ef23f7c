"""RMSNorm (the residual add before it happens as the block's all-reduce arrives)."""

from __future__ import annotations

import torch
from torch import nn

from braid.layers.fused import rms_norm
from braid.layers.linear import ReplicatedLinear


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Hugging Face Llama does, then cast back."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = ReplicatedLinear.load_full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
