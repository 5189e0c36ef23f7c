"""AWQ and GPTQ checkpoints: integer weights in safetensors folders, computed from as GGML blocks.

AutoAWQ (its "gemm" layout) and GPTQ (AutoGPTQ and GPTQModel, formats `gptq` and `gptq_v2`)
store a linear layer's weight as `qweight` (integers packed into int32s), `qzeros` (likewise)
and `scales`, one zero and one scale per output row and group of input columns (GPTQ's `g_idx`
names each column's group); the weight is `(q - zero) * scale`. braid computes
`q * scale + fp16(-zero * scale)`: the same where the zero is 8 or 128, else within half an fp16
step of the minimum `zero * scale`, as llama.cpp's Q4_1 holds it (AWQ's and GPTQ's fp16
kernels round each weight to fp16 likewise). Where every run of 32 consecutive columns lies in
one group (any group size that is a multiple of 32, unless GPTQ's act-order scattered the
groups), that is exactly a row of llama.cpp's blocks:

- Q4_0 (`d = scale`, values `q - 8`) where every zero is 8 (GPTQ's symmetric 4 bits);
- Q4_1 (`d = scale`, `m = fp16(-zero * scale)`);
- Q8_0 (`d = scale`, values `q - 128`) where every zero is 128 (GPTQ's symmetric 8 bits).

So the loader hands the layers those blocks (`LazyWeight.ggml_type`) and braid's GGUF kernels
compute from them with no dense copy (`braid.layers.ggml_weight`); a weight the blocks cannot
hold (act-order groups, asymmetric 8 bits), a layer that reads its weight as a matrix, or a
launch that does not keep blocks gets the dequantized weight instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from braid.loader.weights import LazyWeight

# GGML's type numbers (gguf.GGMLQuantizationType), so rank processes need not import gguf
Q4_0, Q4_1, Q8_0 = 2, 3, 8
# Columns per GGML block of these types
BLOCK = 32
# The tensors that hold one quantized linear weight, by their names' last segment
PARTS = ("qweight", "qzeros", "scales", "g_idx")
# AutoAWQ's "gemm" layout packs output columns c..c+7 of an int32 in this order, lowest bits
# first; REVERSE[j] is the position of column c+j
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))


@dataclass(frozen=True)
class IntegerWeights:
    """How a checkpoint's `quantization_config` packs its weights: `method` ("awq" or
    "gptq"), `bits`, and `zero_offset` (GPTQ's original format stores each zero minus one)."""

    method: str
    bits: int
    zero_offset: int = 0


def integer_weights(config: dict | None) -> IntegerWeights | None:
    """The scheme of a `quantization_config` that `braid.models.config_fields` accepted (None:
    an unquantized checkpoint)."""
    if not config:
        return None
    method = config["quant_method"]
    bits = config.get("bits", config.get("w_bit"))
    original_gptq = method == "gptq" and config.get("checkpoint_format", "gptq") == "gptq"
    return IntegerWeights(method, bits, zero_offset=1 if original_gptq else 0)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 `[r, c]`, each holding 32 / bits values lowest bits first, as uint8
    `[r, c * 32 / bits]`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's int32 `[r, c]` as uint8 `[r, 8c]` with the columns in order."""
    values = _unpack(packed, 4).view(packed.shape[0], -1, 8)
    return values[:, :, list(AWQ_REVERSE)].reshape(packed.shape[0], -1)


class IntegerWeight(LazyWeight):
    """One linear weight `[out, in]` of an AWQ or GPTQ checkpoint. With `keep_blocks`, where
    GGML blocks hold it exactly, it has their `ggml_type` and `block_rows` builds them;
    `narrow` dequantizes (fp32)."""

    def __init__(self, parts: dict[str, LazyWeight], scheme: IntegerWeights,
                 keep_blocks: bool) -> None:
        self.scheme = scheme
        self._qweight = parts["qweight"]
        scales = parts["scales"].load()
        groups, out = scales.shape
        self._scales = scales.t().contiguous()  # [out, groups]
        zeros = parts["qzeros"].load()
        zeros = _unpack_awq(zeros) if scheme.method == "awq" else _unpack(zeros, scheme.bits)
        self._zeros = (zeros[:, :out].t().to(torch.int16) + scheme.zero_offset).contiguous()
        columns = (self._qweight.shape[0] if scheme.method == "awq"
                   else self._qweight.shape[0] * 32 // scheme.bits)
        self.shape = (out, columns)
        if "g_idx" in parts:
            self._group = parts["g_idx"].load().long()
        else:
            self._group = torch.arange(columns) // -(-columns // groups)
        if keep_blocks:
            self.ggml_type = self._block_type()

    def _block_type(self) -> int | None:
        columns = self.shape[1]
        if columns % BLOCK or not (self._group.view(-1, BLOCK) == self._group[::BLOCK, None]).all():
            return None  # groups that are not runs of 32 columns (act-order)
        if self.scheme.bits == 8:
            return Q8_0 if (self._zeros == 128).all() else None
        return Q4_0 if (self._zeros == 8).all() else Q4_1

    def _ints(self, start: int, length: int) -> torch.Tensor:
        """The integer weights of rows `[start, start + length)`, uint8 `[length, in]`."""
        if self.scheme.method == "gptq":  # values packed down the columns
            packed = self._qweight.narrow(1, start, length)
            return _unpack(packed.t().contiguous(), self.scheme.bits)
        first, last = start // 8, -(-(start + length) // 8)  # the int32s holding the rows
        values = _unpack_awq(self._qweight.narrow(1, first, last - first))
        return values[:, start - first * 8:][:, :length].t().contiguous()

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 1:
            return self.narrow(0, 0, self.shape[0]).narrow(1, start, length).contiguous()
        scales = self._scales[start:start + length]
        minimums = self._minimums(scales, start, length).float()[:, self._group]
        return self._ints(start, length).float() * scales.float()[:, self._group] + minimums

    def _minimums(self, scales: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """fp16 `-zero * scale` of rows `[start, start + length)` (`scales` theirs)."""
        zeros = self._zeros[start:start + length]
        return (-(zeros.float() * scales.float())).to(torch.float16)

    def block_rows(self, start: int, length: int) -> torch.Tensor:
        if self.ggml_type is None:
            return super().block_rows(start, length)
        ints = self._ints(start, length).view(length, -1, BLOCK)
        blocks = ints.shape[1]
        scales = self._scales[start:start + length]
        minimums = self._minimums(scales, start, length)
        group = self._group[::BLOCK]
        scales, minimums = scales[:, group], minimums[:, group]

        def as_bytes(halves: torch.Tensor) -> torch.Tensor:
            return halves.to(torch.float16).contiguous().view(torch.uint8).view(length, blocks, 2)

        if self.ggml_type == Q8_0:
            values = (ints.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
            parts = [as_bytes(scales), values]
        else:
            nibbles = ints[..., :16] | (ints[..., 16:] << 4)
            parts = [as_bytes(scales), nibbles]
            if self.ggml_type == Q4_1:
                parts.insert(1, as_bytes(minimums))
        return torch.cat(parts, dim=-1).view(length, -1)


def integer_checkpoint_weights(weights: Iterable[tuple[str, LazyWeight]],
                               scheme: IntegerWeights, keep_blocks: bool
                               ) -> Iterator[tuple[str, LazyWeight]]:
    """`weights` with each quantized layer's parts (`X.qweight`, `X.qzeros`, `X.scales`,
    `X.g_idx`) as one `X.weight` (`IntegerWeight`), yielded after the rest; `ValueError`
    naming a layer whose parts are incomplete."""
    layers: dict[str, dict[str, LazyWeight]] = {}
    for name, weight in weights:
        prefix, _, part = name.rpartition(".")
        if part in PARTS:
            layers.setdefault(prefix, {})[part] = weight
        else:
            yield name, weight
    for prefix, parts in layers.items():
        missing = [p for p in PARTS[:3] if p not in parts]
        if missing:
            raise ValueError(f"{prefix}: the checkpoint's {scheme.method.upper()} weight has "
                             f"no {', '.join(missing)}")
        yield f"{prefix}.weight", IntegerWeight(parts, scheme, keep_blocks)
