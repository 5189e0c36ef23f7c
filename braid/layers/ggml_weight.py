"""Weights kept in llama.cpp's quantized blocks, as a GGUF file stores them.

A GGUF file's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K tensors are loaded as their bytes (a
rank copies the rows, or the whole blocks of columns, it keeps) and computed from by braid's
operators (`csrc/ggml_blocks.cpp`): no dequantized copy exists, so a rank holds its share of
the file's bytes. `torch.ops.braid.ggml_linear` decodes weight rows in registers (up to four
input rows), in tiles (up to FEW_ROWS) or in chunks handed to ATen's GEMM (more); an embedding
lookup decodes the rows it reads. Decoded values are those of the `gguf` package's
`dequantize`, so results equal those over the dequantized weight in the same dtype (the same
bits, up to FEW_ROWS rows), except where the few-row GEMMs round their inputs to int8 as
llama.cpp does (`rounds_inputs`, `--block-inputs int8`: `csrc/ggml_int8.cpp`,
`csrc/ggml_int8_avx2.cpp`). For that kernel Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants are
rearranged at load, 16 rows to a group (`interleave_rows`: same bytes, in the order its vectors
read them); on CPUs without AMX their GEMMs of every row count (prefill too; but Q6_K's) round
their inputs, as llama.cpp's do: there the int8 kernel beats decoding tiles for a bf16 GEMM.

Loading goes through the layers' usual weight loaders: where a checkpoint tensor has blocks
(`LazyWeight.ggml_type`) and the layer computes from them, the loader files the rows under the
parameter (`file_blocks`); once every tensor is loaded, `keep_blocks` gives each layer its
`GGMLWeight` and drops the dense parameter's memory. A layer that reads its weight as a matrix
(MLA's `kv_b_proj`), a fused parameter that a checkpoint fills partly with dense tensors, and
MoE experts get the dequantized weights instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from braid import native
from braid.config import EngineConfig
from braid.layers import decode_kernel
from braid.loader.model_config import ModelConfig
from braid.platform import release_free_memory

# GEMMs of at most this many rows run the few-row kernel over decoded tiles; larger ones
# decode chunks of rows for ATen's GEMM (docs/kernel-choices.md, "GGUF blocks")
FEW_ROWS = 32
# (`ggml_linear`'s row limit meaning "any number")
ALL_ROWS = 2**62
# Weights merged between two trims of the heap (a trim walks the heap: milliseconds)
TRIM_EVERY = 16
# GGML's types that braid interleaves 16 rows to a group for its int8 kernel
# (`interleave_rows`; `csrc/ggml_format.h`), each then numbered X16 + its type
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
X16, X16_ROWS = 1000, 16
# Per interleaved type, what a block holds: its fp16 factors (the scale d, and Q4_1's and
# Q5_1's minimum or the K-quants' dmin), bytes of sub-block scales (the K-quants') and bytes of
# quants (the 5-bit formats' qh, then their nibbles), in that order but for Q6_K's (quants,
# scales, d)
_LAYOUT = {Q4_0: (1, 0, 16), Q4_1: (2, 0, 16), Q5_0: (1, 0, 20), Q5_1: (2, 0, 20),
           Q8_0: (1, 0, 32), Q4_K: (2, 12, 128), Q5_K: (2, 12, 160), Q6_K: (1, 16, 192)}
INTERLEAVED_TYPES = frozenset(_LAYOUT)
# The interleaved types whose int8 kernel beats decoding them for a bf16 GEMM at every row
# count (`round_all_rows`); Q6_K's, which puts each quant together from two vectors, loses
# from a few dozen rows on (docs/kernel-choices.md)
_INT8_AT_ANY_ROWS = {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K}


def weight_rows(blocks: torch.Tensor, kind: int) -> int:
    """The weight rows a tensor of blocks of GGML type `kind` holds."""
    return blocks.shape[0] * (X16_ROWS if kind > X16 else 1)


def rounds_inputs(kind: int, dtype: torch.dtype, columns: int) -> bool:
    """Whether GEMMs of up to FEW_ROWS rows over blocks of GGML type `kind`, with `dtype` inputs
    of `columns` columns, can round the inputs to int8 and multiply them with the blocks' quants
    in integers, as llama.cpp does (`--block-inputs int8`, the default): Q4_K, Q6_K, Q8_0 and
    the interleaved forms of INTERLEAVED_TYPES (`interleave_rows`), bf16 and fp32 on CPUs with
    AVX512-VNNI (Q5_0 and Q5_1: and VBMI; `csrc/ggml_int8.cpp`); Q4_K, Q6_K and Q8_0, fp32 on
    AVX2-only ones (`csrc/ggml_int8_avx2.cpp`)."""
    return torch.ops.braid.ggml_int8_serves(kind, dtype, columns)


@dataclass
class GGMLWeight:
    """A layer's weight `[rows, columns]` as runs of rows in GGML blocks: `types[i]` and
    `blocks[i]` (uint8, `[rows_i, bytes]`) for consecutive runs (one where the checkpoint's
    tensors of a fused parameter share a format). `round_inputs`: GEMMs of a few rows round
    their inputs to int8 where a kernel does (`rounds_inputs`; `--block-inputs`), and with
    `round_all_rows` GEMMs of any number of rows over interleaved groups do (but Q6_K's)."""

    columns: int
    types: list[int]
    blocks: list[torch.Tensor]
    round_inputs: bool = True
    round_all_rows: bool = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T`, in `x`'s dtype."""
        rows = x.reshape(-1, x.shape[-1])
        parts = [torch.ops.braid.ggml_linear(rows, blocks, kind, FEW_ROWS, self._int8_rows(kind))
                 for kind, blocks in zip(self.types, self.blocks)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _int8_rows(self, kind: int) -> int:
        """The rows up to which a GEMM over blocks of `kind` rounds its inputs to int8."""
        if not self.round_inputs:
            return 0
        return ALL_ROWS if kind - X16 in _INT8_AT_ANY_ROWS and self.round_all_rows else FEW_ROWS

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight in `dtype` (an embedding; one run of rows)."""
        (kind,), (blocks,) = self.types, self.blocks
        flat = ids.reshape(-1)
        if kind > X16:
            rows, kind = plain_rows(blocks, kind - X16, flat), kind - X16
        else:
            rows = blocks.index_select(0, flat)
        out = torch.ops.braid.ggml_dequantize(rows, kind, self.columns, dtype)
        return out.view(*ids.shape, self.columns)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([torch.ops.braid.ggml_dequantize(blocks, kind, self.columns, dtype)
                          for kind, blocks in zip(self.types, self.blocks)])


def keeps_quantized_blocks(engine: EngineConfig, config: ModelConfig) -> bool:
    """Whether a launch of `engine` keeps its checkpoint's quantized blocks: a GGUF file or an
    AWQ/GPTQ folder (`braid.loader.awq_gptq`), `--quantization auto`, on a CPU whose block
    kernels serve the run's dtype (`decode_kernel.block_kernels_serve`; elsewhere the blocks
    are dequantized at load), with braid's operators built."""
    quantized = Path(engine.model).is_file() or bool(config.extra.get("quantization_config"))
    return (engine.compile.quantization == "auto" and quantized
            and engine.parallel.device == "cpu"
            and decode_kernel.block_kernels_serve(engine.torch_dtype) and native.load())


def file_blocks(param: nn.Parameter, row: int, kind: int, blocks: torch.Tensor) -> None:
    """File `blocks` (GGML type `kind`) as `param`'s rows from `row` on, for `keep_blocks`."""
    if not hasattr(param, "ggml_runs"):
        param.ggml_runs = []
    param.ggml_runs.append((row, kind, blocks))


def keep_blocks(model: nn.Module) -> int:
    """Give every layer whose weight was loaded as blocks its `GGMLWeight` (`layer.ggml`),
    freeing the dense parameter (a zero-stride view keeps its shape); a parameter that a
    checkpoint filled partly with dense rows gets its block rows dequantized into it instead.
    The bytes kept as blocks."""
    kept: dict[int, GGMLWeight | None] = {}
    for layer in model.modules():
        param = _dense_weight(layer)
        if param is None or not (id(param) in kept or hasattr(param, "ggml_runs")):
            continue
        if id(param) not in kept:  # a tied weight is finished once, for both its layers
            kept[id(param)] = _finish(param)
            if len(kept) % TRIM_EVERY == 0:  # the runs merged so far: else the heap keeps them
                release_free_memory()
        layer.ggml = kept[id(param)]
    return sum(w.nbytes for w in kept.values() if w is not None)


def set_input_rounding(model: nn.Module, round_inputs: bool, all_rows: bool,
                       dtype: torch.dtype) -> None:
    """Whether the few-row GEMMs over every block weight of `model` (a checkpoint's or
    `--quantization int4|int8`'s) round their inputs to int8 (`--block-inputs`); where they do and
    this CPU's kernel multiplies `dtype` inputs by 16 rows at a time, the weights of the formats in
    INTERLEAVED_TYPES are interleaved for it (`interleave_rows`; a tied embedding shares the
    result), and with `all_rows` their GEMMs of any number of rows round their inputs too (but
    Q6_K's: `_INT8_AT_ANY_ROWS`)."""
    seen: set[int] = set()
    for layer in model.modules():
        weight = getattr(layer, "ggml", None)
        if weight is None or id(weight) in seen:
            continue
        seen.add(id(weight))
        weight.round_inputs, weight.round_all_rows = round_inputs, all_rows
        for run, (kind, blocks) in enumerate(zip(weight.types, weight.blocks)):
            if (round_inputs and kind in INTERLEAVED_TYPES
                    and blocks.shape[0] % X16_ROWS == 0
                    and rounds_inputs(X16 + kind, dtype, weight.columns)):
                weight.types[run], weight.blocks[run] = X16 + kind, interleave_rows(blocks, kind)


def _words_by_lane(section: torch.Tensor) -> torch.Tensor:
    """`[groups, 16 rows, blocks, bytes]` as `[groups, blocks * 16 * bytes]`: per block,
    vectors of 64 bytes whose lane r holds 4 of row r's bytes (a copy)."""
    words = section.unflatten(-1, (section.shape[-1] // 4, 4)).permute(0, 2, 3, 1, 4)
    return words.reshape(section.shape[0], -1)


def interleave_rows(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """Blocks of a format in INTERLEAVED_TYPES `[rows, bytes]` (rows a multiple of 16) as braid's
    interleaved groups `[rows / 16, 16 * bytes]` (type X16 + kind): per group of 16 rows, for each
    block vectors of 64 bytes whose lane r holds 4 bytes of row r's quants (Q8_0's plus 128; the
    5-bit formats' qh, then their nibbles; Q6_K's ql, then qh), then the group's fp16 factors (16 a
    block: the scales, then Q4_1's and Q5_1's minimums or the K-quants' dmin), then the K-quants'
    sub-block scales, 4 bytes of each row a vector. The int8 kernel multiplies 16 rows by 4 inputs
    an instruction, the 16 rows' scales arrive in one vector and no row's sum needs a horizontal
    reduction: about a third of the instructions a weight of the row-by-row kernel
    (`csrc/ggml_int8.cpp`)."""
    rows = blocks.shape[0]
    halves, scales, quants = _sections(blocks.view(rows // X16_ROWS, X16_ROWS, -1,
                                                   _block_bytes(kind)), kind)
    halves = halves.unflatten(-1, (-1, 2)).permute(0, 3, 2, 1, 4)
    quants = _words_by_lane(quants)
    if kind == Q8_0:
        quants.bitwise_xor_(0x80)
    return torch.cat([quants, halves.reshape(halves.shape[0], -1), _words_by_lane(scales)], dim=1)


def _block_bytes(kind: int) -> int:
    factors, scale_bytes, quant_bytes = _LAYOUT[kind]
    return 2 * factors + scale_bytes + quant_bytes


def _sections(blocks: torch.Tensor, kind: int) -> tuple[torch.Tensor, ...]:
    """A block's (fp16 factors' bytes, sub-block scales, quants), in the last dimension."""
    factors, scale_bytes, quant_bytes = _LAYOUT[kind]
    if kind == Q6_K:
        quants, scales, halves = blocks.split([quant_bytes, scale_bytes, 2 * factors], dim=-1)
    else:
        halves, scales, quants = blocks.split([2 * factors, scale_bytes, quant_bytes], dim=-1)
    return halves, scales, quants


def plain_rows(groups: torch.Tensor, kind: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of interleaved `groups` of `kind` as its blocks `[len(ids), bytes]`
    (`interleave_rows` undone for them alone)."""
    factors, scale_bytes, quant_bytes = _LAYOUT[kind]
    count = groups.shape[0]
    blocks = groups.shape[1] // (X16_ROWS * _block_bytes(kind))
    quants, halves, scales = groups.split([blocks * X16_ROWS * quant_bytes,
                                           blocks * X16_ROWS * 2 * factors,
                                           blocks * X16_ROWS * scale_bytes], dim=1)
    quants = quants.view(count, blocks, -1, X16_ROWS, 4)
    halves = halves.view(count, factors, blocks, X16_ROWS, 2)
    scales = scales.view(count, blocks, -1, X16_ROWS, 4)
    group, lane = ids // X16_ROWS, ids % X16_ROWS
    row_quants = quants[group, :, :, lane].flatten(-2)  # [n, blocks, quant_bytes]: a copy
    if kind == Q8_0:
        row_quants.bitwise_xor_(0x80)
    row_halves = halves[group, :, :, lane].permute(0, 2, 1, 3).flatten(-2)  # [n, blocks, 2 f]
    row_scales = scales[group, :, :, lane].flatten(-2)  # [n, blocks, scale_bytes]
    parts = ([row_quants, row_scales, row_halves] if kind == Q6_K
             else [row_halves, row_scales, row_quants])
    return torch.cat(parts, dim=-1).flatten(1)


def _dense_weight(layer: nn.Module) -> nn.Parameter | None:
    from braid.layers.quant import Quantizable

    if isinstance(layer, Quantizable):
        return layer.quantizable_weight()
    return getattr(layer, "weight", None) if hasattr(layer, "ggml") else None


def _finish(param: nn.Parameter) -> GGMLWeight | None:
    runs = sorted(param.ggml_runs, key=lambda run: run[0])
    del param.ggml_runs
    rows, columns = param.shape
    if sum(blocks.shape[0] for _, _, blocks in runs) < rows:  # some rows came dense
        for row, kind, blocks in runs:
            one = GGMLWeight(columns, [kind], [blocks])
            param.data[row:row + blocks.shape[0]] = one.dequantize(param.dtype)
        return None
    types, merged = [], []
    for _, kind, blocks in runs:  # consecutive runs of one format become one
        if types and types[-1] == kind:
            merged[-1].append(blocks)
        else:
            types.append(kind)
            merged.append([blocks])
    weight = GGMLWeight(columns, types, [torch.cat(b) if len(b) > 1 else b[0] for b in merged])
    param.data = torch.zeros((), dtype=param.dtype).expand(rows, columns)
    return weight
