"""RMSNorm (the residual add before it happens as the block's all-reduce arrives), and Gemma's
form of it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from braid.layers.fused import rms_norm
from braid.layers.linear import ReplicatedLinear, _copy_checked
from braid.loader.weights import LazyWeight


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Hugging Face Llama does, then cast back."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = ReplicatedLinear.load_full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: `x / rms(x) * (1 + w)`, all in fp32, then cast back. The checkpoint
    stores `w`; the module keeps `1 + w` in fp32 (from `w` rounded to the model's dtype, as
    transformers holds it), so the scale is one multiply."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.dtype = dtype
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.load_offset

    def load_offset(self, param: nn.Parameter, weight: LazyWeight, shard_id: object = None) -> None:
        _copy_checked(param.data, 1.0 + weight.load().to(self.dtype).float(), "norm weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
