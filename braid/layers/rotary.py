"""Rotary position embedding: default, linear, llama3, YaRN and LongRoPE frequencies; the neox
layout (rotate halves) or DeepSeek's interleaved pairs."""

from __future__ import annotations

import math

import torch
from torch import nn

from braid.errors import UserError
from braid.layers.fused import rotate
from braid.loader.model_config import rope_kind


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, smooth in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float,
                   scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): high frequencies kept, low ones divided by `factor`, a linear
    ramp between the `beta_fast`/`beta_slow` rotation counts; returns (inv_freq, cos/sin scale)."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def _longrope_angles(positions: torch.Tensor, inv_freq: torch.Tensor,
                     scaling: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its own factor, the `short_factor` list
    within the original context and the `long_factor` list beyond it, and cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original context)). transformers picks one list for a whole
    forward pass from its longest position, so keys cached before a sequence crossed the
    original context keep their short-factor rotation there too; here the list follows each
    token's own position, which is the same within the original context, where every test
    and most prompts stay. `scaling` holds the factors and `original_max_position_embeddings`
    and `factor` (the model class fills them from the config)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]
    magnitude = scaling.get("attention_factor")
    if magnitude is None:
        magnitude = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)
    long = inv_freq / torch.tensor(scaling["long_factor"], dtype=torch.float64)
    angles = torch.where(positions[:, None] < original, torch.outer(positions, short),
                         torch.outer(positions, long))
    return angles, float(magnitude)


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to query and key heads at given positions.

    `interleaved`: the rotated pairs are (x0, x1), (x2, x3), ... (DeepSeek) instead of
    (x_i, x_{i + d/2}). The output is then laid out as [evens rotated, odds rotated]: a fixed
    permutation of both q and k, which leaves every q.k product unchanged.
    """

    def __init__(self, head_dim: int, max_positions: int, base: float,
                 scaling: dict | None = None, interleaved: bool = False) -> None:
        super().__init__()
        self.interleaved = interleaved
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        kind = rope_kind(scaling)
        magnitude = 1.0
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "yarn":
            inv_freq, magnitude = _yarn_inv_freq(inv_freq, head_dim, base, scaling)
        elif kind not in ("default", "longrope"):
            raise UserError(f"rope scaling {kind!r} is not supported for this model")
        t = torch.arange(max_positions, dtype=torch.float64)
        if kind == "longrope":
            freqs, magnitude = _longrope_angles(t, inv_freq, scaling)
        else:
            freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", (freqs.cos() * magnitude).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * magnitude).float(), persistent=False)
        self._recent: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos, sin = self._angles(positions)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate(self, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of `heads` ([tokens, heads, head_dim], any heads: the query and
        key heads of a fused projection in one call, half the small ops of two)."""
        cos, sin = self._angles(positions)
        return self._rotate(heads, cos, sin)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions` ([tokens, 1, dim / 2]). Every layer shares this module
        and the step's positions tensor, so the lookup runs once per step (per micro-batch
        under overlap: the last two are kept), not once per layer. A compiled step looks them
        up in its graph (the cache would be a guard on the tensor's identity)."""
        if torch.compiler.is_compiling():
            return self._lookup(positions)
        for seen, cos, sin in self._recent:
            if seen is positions:
                return cos, sin
        cos, sin = self._lookup(positions)
        self._recent = [(positions, cos, sin), *self._recent[:1]]
        return cos, sin

    def _lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.sin.index_select(0, positions).unsqueeze(1))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate(x, cos, sin, self.interleaved)
