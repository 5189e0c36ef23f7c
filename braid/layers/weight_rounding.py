"""`--quantization int4|int8`: a checkpoint's linear weights rounded at load into llama.cpp's
blocks, then computed from as a GGUF file's blocks are (`braid.layers.ggml_weight`); no dense
copy is kept.

A rank rounds the weights it holds, row by row in blocks along the columns.

- **int8**: Q8_0 where the rows' length and the rank's slice of them are multiples of 32 (an
  fp16 scale per 32 weights, each weight the nearest of 255 levels of it: 8.5 bits a weight),
  else the layer stays dense. Where the int8 kernel serves, the blocks are then
  interleaved 16 rows to a group for it (`ggml_weight.interleave_rows`).
- **int4**: Q4_K where the rows' length and the rank's slice of them are multiples of 256
  (super-blocks of 8 sub-blocks of 32, each with a 6-bit scale and minimum under the block's
  two fp16 factors: 4.5 bits a weight), else Q4_1 where they are multiples of 32 (an fp16 scale
  and minimum per 32: 5 bits a weight), else the layer stays dense. Scales and minimums are
  chosen from each sub-block's range (llama.cpp's quantizer searches for a slightly better
  fit).

Blocks are those of the whole rows, so a weight is rounded alike at every tp where its slices
fall on them (a rank whose slice of a row-parallel layer does not falls back to the smaller
blocks, or to dense). Each weight is rounded to the nearest level of the stored (fp16, 6-bit)
factors.

The layers that read their weight as a matrix (MLA's `kv_b_proj`) and MoE experts stay dense;
an embedding tied to an LM head shares the head's blocks (lookups decode their rows).
"""

from __future__ import annotations

import torch
from torch import nn

from braid.layers.ggml_weight import Q8_0, GGMLWeight
from braid.layers.quant import Quantizable

# GGML's type numbers (the `gguf` package's `GGMLQuantizationType`, which rank processes do not
# import: see test_launch)
Q4_1, Q4_K = 3, 12
SUPER_BLOCK, BLOCK = 256, 32
# Rows rounded at a time: bounds the fp32 temporaries to a few times this many rows' bytes
ROWS_AT_ONCE = 2048


def _fp16(values: torch.Tensor) -> torch.Tensor:
    """`values` as the fp16 a block stores, back in fp32."""
    return values.to(torch.float16).float()


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp16 values as their two little-endian bytes each, `[..., 2]`."""
    return values.to(torch.float16).contiguous().view(torch.uint8).view(*values.shape, 2)


def _levels(x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """x = scale * q - minimum rounded to the nearest q in 0..15 (a zero scale: q 0)."""
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return torch.round((x + minimum) * inverse).clamp_(0, 15).to(torch.uint8)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Levels `[..., 64]` packed as llama.cpp packs 64 of them: byte l holds level l in its low
    nibble and level 32 + l in its high one."""
    return q[..., :32] | (q[..., 32:] << 4)


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """`weight [rows, columns]` (columns a multiple of 32) as Q4_1 blocks `[rows, columns / 32
    * 20]`: per 32 weights the fp16 scale d and minimum m, then 16 bytes of levels q, for
    w = d q + m."""
    rows, columns = weight.shape
    x = weight.float().view(rows, columns // BLOCK, BLOCK)
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    minimum = _fp16(low)
    scale = _fp16((high - minimum) / 15)
    q = _levels(x, scale, -minimum)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([_fp16_bytes(scale[..., 0]), _fp16_bytes(minimum[..., 0]), packed],
                     dim=-1).view(rows, -1)


def _pack_scales(scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and minimums `[..., 8]` in the 12 bytes Q4_K keeps them in: for
    j < 4, bytes j and j + 4 hold scale and minimum j in their low 6 bits and the top 2 bits of
    scale and minimum j + 4 above them; bytes 8-11 hold the low 4 bits of both for j + 4."""
    low_s, high_s = scales[..., :4], scales[..., 4:]
    low_m, high_m = minimums[..., :4], minimums[..., 4:]
    return torch.cat([low_s | ((high_s >> 4) << 6), low_m | ((high_m >> 4) << 6),
                      (high_s & 15) | ((high_m & 15) << 4)], dim=-1)


def quantize_q4_k(weight: torch.Tensor) -> torch.Tensor:
    """`weight [rows, columns]` (columns a multiple of 256) as Q4_K blocks `[rows, columns /
    256 * 144]`: per 256 weights the fp16 factors d and dmin, 12 bytes of 6-bit sub-block
    scales s and minimums m, then 128 bytes of levels q, for w = d s_j q - dmin m_j in
    sub-block j of 32."""
    rows, columns = weight.shape
    x = weight.float().view(rows, columns // SUPER_BLOCK, 8, BLOCK)
    low = x.amin(-1).clamp(max=0)  # a sub-block's minimum is never above zero
    spread = (x.amax(-1) - low) / 15
    d = _fp16(spread.amax(-1, keepdim=True) / 63)
    dmin = _fp16((-low).amax(-1, keepdim=True) / 63)
    scales = torch.where(d > 0, torch.round(spread / d), torch.zeros_like(spread)).clamp_(0, 63)
    minimums = torch.where(dmin > 0, torch.round(-low / dmin),
                           torch.zeros_like(low)).clamp_(0, 63)
    q = _levels(x, (d * scales)[..., None], (dmin * minimums)[..., None])
    # 64 weights (two sub-blocks) a group of 32 bytes
    levels = _nibbles(q.view(rows, columns // SUPER_BLOCK, 4, 64)).flatten(-2)
    packed_scales = _pack_scales(scales.to(torch.uint8), minimums.to(torch.uint8))
    return torch.cat([_fp16_bytes(d[..., 0]), _fp16_bytes(dmin[..., 0]), packed_scales, levels],
                     dim=-1).view(rows, -1)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """`weight [rows, columns]` (columns a multiple of 32) as Q8_0 blocks `[rows, columns / 32
    * 34]`: per 32 weights the fp16 scale d (the largest |w| / 127), then 32 signed bytes q,
    for w = d q."""
    rows, columns = weight.shape
    x = weight.float().view(rows, columns // BLOCK, BLOCK)
    scale = _fp16(x.abs().amax(-1, keepdim=True) / 127)
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(x * inverse).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat([_fp16_bytes(scale[..., 0]), q], dim=-1).view(rows, -1)


def rounded_blocks(weight: torch.Tensor, bits: int, first_column: int = 0,
                   row_length: int | None = None) -> GGMLWeight | None:
    """`weight` (a rank's columns from `first_column` on, of rows `row_length` long: by
    default the whole rows) in the blocks of `bits` (4 or 8) that cut the whole rows where its
    columns begin and end, so that every split rounds alike: Q8_0; Q4_K, else Q4_1 (None:
    none fits)."""
    rows, columns = weight.shape
    row_length = columns if row_length is None else row_length

    def fits(block: int) -> bool:
        return first_column % block == 0 and columns % block == 0 and row_length % block == 0

    if bits == 8 and fits(BLOCK):
        kind, quantize = Q8_0, quantize_q8_0
    elif bits == 4 and fits(SUPER_BLOCK):
        kind, quantize = Q4_K, quantize_q4_k
    elif bits == 4 and fits(BLOCK):
        kind, quantize = Q4_1, quantize_q4_1
    else:
        return None
    blocks = torch.cat([quantize(weight[i:i + ROWS_AT_ONCE])
                        for i in range(0, rows, ROWS_AT_ONCE)])
    return GGMLWeight(columns, [kind], [blocks])


def round_linear_weights(model: nn.Module, bits: int) -> None:
    """Round every dense, packable linear weight of `model` into blocks of `bits` (4 or 8;
    `layer.ggml`), freeing the dense parameter (a zero-stride view keeps its shape); an
    embedding tied to one of them shares its blocks."""
    made: dict[int, GGMLWeight | None] = {}
    for layer in model.modules():
        if not isinstance(layer, Quantizable) or not layer.packable or layer.ggml is not None:
            continue
        param = layer.quantizable_weight()
        if id(param) not in made:
            # A row-parallel layer's columns are a slice of its rows
            first_column = getattr(layer, "in_range", (0, None))[0]
            row_length = getattr(layer, "in_features", param.shape[1])
            made[id(param)] = rounded_blocks(param.data, bits, first_column, row_length)
            if made[id(param)] is not None:
                param.data = torch.zeros((), dtype=param.dtype).expand(param.shape)
        layer.ggml = made[id(param)]
    for layer in model.modules():  # embeddings tied to a quantized head
        weight = getattr(layer, "weight", None)
        if hasattr(layer, "ggml") and layer.ggml is None and id(weight) in made:
            layer.ggml = made[id(weight)]
