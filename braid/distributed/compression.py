"""Partial sums sent compressed, for all-reduces over links slower than the compute.

A compressed all-reduce is an all-gather of each rank's packed partial sum followed, on every
rank, by a sum of all of them in fp32, in rank order: every rank gets the same bits, so the
ranks' activations stay identical (only their distance from the exact sum grows). Two ranks
then send each other one packing per reduce, where a ring all-reduce of bf16 sends two bytes an
element.

- `int8`: a scale per block of 64 elements (its largest magnitude / 127) and each element
  rounded to the nearest multiple: 1.06 bytes an element, an error of at most half a step
  (`max_error`).
- `bf16`: the partial sums rounded to bf16 (for fp32 models; a bf16 model's sums already are).

Where the link is not the bottleneck the packing costs more than it saves: `--comm-compression
auto` measures which is faster while serving (`braid.engine.step_choice`). Figures:
docs/multi-host.md, "Slow links: overlap and compressed partial sums".
"""

from __future__ import annotations

import torch

from braid import native

COMPRESSIONS = ("none", "bf16", "int8")
BLOCK = 64  # elements per int8 scale (csrc/int8_blocks.cpp)


def _flat_blocks(x: torch.Tensor) -> torch.Tensor:
    """`x` as one row of whole blocks (zeros pad the last)."""
    flat = x.reshape(-1)
    pad = -flat.numel() % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)) if pad else flat


def _uses_native(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and native.load())


def pack(x: torch.Tensor, kind: str) -> torch.Tensor:
    """`x` (contiguous) as this rank sends it: a 1-D tensor, the same size on every rank."""
    if kind == "bf16":
        # A copy even where `x` is bf16 already: gloo reads the packing from its own thread
        # until the wait, while the step goes on and owns `x`
        return x.reshape(-1).to(torch.bfloat16, copy=True)
    blocks = _flat_blocks(x)
    if _uses_native(blocks):
        return torch.ops.braid.quantize_blocks(blocks)
    f = blocks.float().view(-1, BLOCK)
    largest = f.abs().amax(1)
    inverse = torch.where(largest > 0, torch.full_like(largest, 127.0) / largest, 0.0)
    # A block with NaN or inf: values 0 (their int8 conversion would be undefined), scale NaN,
    # so its sum is NaN on every rank (as the C++ packing does)
    finite = largest.isfinite()
    values = torch.where(finite[:, None], torch.round(f * inverse[:, None]), 0)
    scales = torch.where(finite, largest / 127, torch.nan)
    return torch.cat([values.to(torch.int8).view(-1), scales.view(torch.int8)])


def unpack_sum(gathered: torch.Tensor, kind: str, ranks: int, like: torch.Tensor,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """The sum, in fp32 and rank order, of the `ranks` packings gathered end to end, plus
    `residual` where given; shaped and typed like `like`, the partial sum that was packed."""
    if kind == "bf16":
        total = gathered.view(ranks, -1).float().sum(0).view(like.shape)
        if residual is not None:
            total += residual
        return total.to(like.dtype)
    n = like.numel()
    whole = n + (-n % BLOCK)
    if whole == n and _uses_native(like):
        if residual is not None:
            residual = residual.contiguous()
        return torch.ops.braid.dequantize_sum(gathered, ranks, like, residual)
    packings = gathered.view(ranks, -1)
    values = packings[:, :whole].float().view(ranks, -1, BLOCK)
    scales = packings[:, whole:].contiguous().view(torch.float32)
    total = torch.zeros(whole // BLOCK, BLOCK)
    for r in range(ranks):  # in rank order, as every rank sums
        total += values[r] * scales[r][:, None]
    total = total.view(-1)[:n].view(like.shape)
    if residual is not None:
        total += residual
    return total.to(like.dtype)


def max_error(partials: list[torch.Tensor]) -> torch.Tensor:
    """The most an int8 sum of `partials` may differ from the exact one, per element: half a
    quantization step of each rank's block, plus the rounding of the sum to the partials'
    dtype (one unit in its last place, to leave room for fp32's own rounding)."""
    bound = torch.zeros(partials[0].shape)
    for x in partials:
        largest = _flat_blocks(x).float().view(-1, BLOCK).abs().amax(1, keepdim=True)
        step = (largest / 127).expand(-1, BLOCK).reshape(-1)[: x.numel()].view(x.shape)
        bound += step / 2
    exact = sum(x.float() for x in partials)
    return bound + (exact.abs() + bound) * torch.finfo(partials[0].dtype).eps
