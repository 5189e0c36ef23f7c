"""The weight forms a linear layer's GEMM reads, made at load time from any checkpoint.

**Packed bf16 (CPU, default).** Each bf16 linear weight also gets oneDNN's blocked copy, which
GEMMs of at most `PACKED_MAX_ROWS` rows (decode, short prompts) read: they no longer reorder the
weight on every call. Measured on AMX (2 cores, SmolLM2's shapes, weights streamed from memory):
1.4x faster at 1-128 rows, 2.7x at 256 (where the row-major GEMM takes a slow path);
bit-identical results. With AMX, larger GEMMs read the row-major weight, which is kept: in
whole prefill steps on the same host it was faster from 512 rows on (1 x 512 1.07x, 2 x 512
1.04x, 8 x 512 1.14x, the row-major model faster in 20 of 24 interleaved steps at 512-4096
rows). Without AMX (AVX512-BF16, 2-core Zen 4) the packed weights win at every size: whole
prefill steps 1.04x faster at 1 x 512, 1.11x at 2 x 512, 1.05x at 8 x 512 (best of 6-10
interleaved steps). The copy costs the weights' bytes again. fp32 keeps the row-major weights
only (oneDNN's packed fp32 GEMM was not faster). `--no-weight-packing` turns it off.
A SwiGLU's merged gate/up weight is packed as its two halves instead, and `gated_silu` applies
SiLU and the product in the two GEMMs' oneDNN epilogues (eager decode steps 0.95-0.97x at 1 row
and 0.98-0.99x at 32 against one merged packed GEMM, but no pass over the activation; the
compiled decode step, `--compile on`, reads row-major weights and is unaffected).

**int8 (`--quantization int8`).** Each linear layer's weight gets an int8 copy, symmetric per
output channel (`scale = max |w| / 127`), quantised from this rank's shard. A GEMM of a few rows
(decode at small batch) reads the int8 copy through `aten._weight_int8pack_mm`, half the bytes
of bf16; larger GEMMs keep the dense weight, where that kernel is several times slower
(measured with bf16 activations on AVX-512: 3x faster at 1 row, even at 8, 3.3x slower at 32,
against the row-major weight). The kernel is vectorised for 16-bit activations only, so fp32
models keep the dense path (a warning says so). Inside the compiled decode step (`--compile
on`) the GEMMs of one sequence read the int8 weights through inductor's GEMM template for
them, and so do those of several sequences where the CPU has AMX (see `int8_applies`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from braid.config import cpu_flags
from braid.layers import decode_kernel
from braid.layers.fused import silu_mul

INT8_MAX_ROWS = 4  # GEMMs of at most this many rows use the int8 weights
# Whether the compiled decode step's graph for several sequences reads int8 weights (see
# `int8_applies`); a constant, so that tracing does not read the CPU's flags.
INT8_GRAPH_AT_BATCH = "amx_int8" in cpu_flags()


@dataclass
class Int8Weight:
    """A weight as int8 values `[out, in]` and one scale per output row (activation dtype)."""

    values: torch.Tensor
    scales: torch.Tensor

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int8Weight:
        w = weight.detach().float()
        # Rounded to the activation dtype first: the values are quantised against the scales
        # the kernel will multiply by.
        scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(weight.dtype)
        values = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return Int8Weight(values.contiguous(), scales)

    def dequantize(self) -> torch.Tensor:
        """The weight the int8 values stand for, in fp32."""
        return self.values.float() * self.scales.float()[:, None]


class Quantizable:
    """Mixin of the layers whose weight `quantize_linear_layers` and `pack_linear_layers` give
    other forms; `forward` passes them all to `linear`."""

    int8: Int8Weight | None = None
    packed: torch.Tensor | None = None  # oneDNN's blocked copy, beside the row-major weight
    # False where other code reads the weight as a matrix (MLA's kv_b_proj), or where the
    # row-major weight is the faster GEMM operand (the LM head under tensor parallelism)
    packable = True
    # Set by the compiled decode step where `decode_kernel.gemv_fits` the weight its one-row
    # GEMM reads (int8 or dense): that GEMM is then braid's GEMV operator
    gemv = False
    # Set on a SwiGLU's merged [gate | up] projection (`GatedMLP`): packing then makes
    # `packed_halves`, gate and up packed apart, for `gated_silu` (and no merged copy)
    gated = False
    packed_halves: tuple[torch.Tensor, torch.Tensor] | None = None

    def quantizable_weight(self) -> torch.Tensor:
        return self.weight


def int8_applies(x: torch.Tensor, int8: Int8Weight | None) -> bool:
    """Whether a GEMM of `x` reads the int8 weights: there are some, and `x` has few rows, or
    `x` is traced into the compiled decode step's graph for one sequence (its row count is the
    constant 1), or into its graph for several where the CPU has AMX. Inductor's GEMM template
    for int8 weights beat the dense GEMM at any decode batch with AMX (32 rows: 10.7 against
    13.7 ms for SmolLM2's 121 GEMMs), but on a Zen 4 without AMX int8 at batch 32 decoded at
    0.71x bf16, so there the graph for several sequences keeps the dense weights."""
    if int8 is None or x.dim() != 2:
        return False
    if torch.compiler.is_compiling():
        return x.shape[0] == 1 or INT8_GRAPH_AT_BATCH
    return x.shape[0] <= INT8_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           int8: Int8Weight | None = None, out: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, gemv: bool = False) -> torch.Tensor:
    """`F.linear`, through the int8 weights where `int8_applies`, else through the packed
    weight where there is one and `packed_applies`; with `gemv`, a row traced into the
    compiled step goes through `decode_kernel.gemv` instead (int8 or dense). Written into
    `out` where given (the int8, oneDNN and GEMV kernels return a new tensor, copied once: a few
    rows where it matters)."""
    one_traced_row = (gemv and torch.compiler.is_compiling() and x.dim() == 2
                      and x.shape[0] == 1)
    if int8_applies(x, int8):
        if one_traced_row:
            y = decode_kernel.gemv(x, int8.values, int8.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, int8.values, int8.scales)
        return y if bias is None else y + bias
    if one_traced_row:
        y = decode_kernel.gemv(x, weight)
        y = y if bias is None else y + bias
        return y if out is None else out.copy_(y)
    if packed is not None and packed_applies(x):
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if out is None else out.copy_(y)
    if out is None or x.dim() != 2:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def quantize_linear_layers(model: nn.Module) -> None:
    """Give every `Quantizable` layer (the linear layers, the LM head) its int8 copy. fp32
    models are left dense (see the module docstring)."""
    layers = [m for m in model.modules() if isinstance(m, Quantizable)]
    dtype = layers[0].quantizable_weight().dtype if layers else None
    if dtype == torch.float32:
        warnings.warn("--quantization int8 runs dense: the int8 kernel is fast with bf16 or fp16 "
                      "activations only; use --dtype bf16", stacklevel=2)
        return
    for layer in layers:
        layer.int8 = Int8Weight.quantize(layer.quantizable_weight())


# The row count oneDNN lays the blocks out for (packing for a step's exact row count was no faster)
PACK_HINT_ROWS = 256
# GEMMs of at most this many rows read the packed weights (see the module docstring)
PACKED_MAX_ROWS = 256 if "amx_bf16" in cpu_flags() else None


def packed_applies(x: torch.Tensor) -> bool:
    """Whether a GEMM of `x` reads the packed weights where a layer has them."""
    return PACKED_MAX_ROWS is None or x.numel() <= PACKED_MAX_ROWS * x.shape[-1]


def packing_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed: bf16 on a CPU whose oneDNN computes bf16."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_layers(model: nn.Module) -> None:
    """Give the bf16 weight of every packable linear layer oneDNN's blocked copy, for
    `packed_applies` GEMMs (the row-major weight stays for larger ones). Other dtypes and
    devices stay as they are."""
    for layer in model.modules():
        if not isinstance(layer, Quantizable) or not layer.packable:
            continue
        weight = layer.quantizable_weight()
        if packing_supported(weight):
            if layer.gated:
                layer.packed_halves = tuple(_pack(half.contiguous()) for half in weight.chunk(2))
            else:
                layer.packed = _pack(weight)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)


def swiglu(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a merged [gate | up] projection (`Quantizable.gated`), through the
    weight form `linear` would read: the packed halves (`gated_silu`) where there are some,
    they apply and the int8 weights do not, else the layer's product and `silu_mul`."""
    if (layer.packed_halves is not None and packed_applies(x)
            and not int8_applies(x, layer.int8)):
        return gated_silu(x, *layer.packed_halves)
    return silu_mul(layer(x))


def gated_silu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(x @ gate.T) * (x @ up.T)` for packed `gate` and `up` (`packed_halves`): two oneDNN
    GEMMs, the first applying SiLU to its fp32 sums, the second multiplying its sums by the
    first's output, so neither the merged projection nor the activation is another pass over
    memory. 2-core Xeon with AMX, 4096 rows of SmolLM2 (576 -> 2 x 1536): 6.6 ms against 7.6-7.8
    for the merged GEMM and the compiled `silu_mul`."""
    rows = x.reshape(-1, x.shape[-1])
    activated = torch.ops.mkldnn._linear_pointwise(rows, gate, None, "swish", [], "")
    y = torch.ops.mkldnn._linear_pointwise.binary(rows, activated, up, None, "mul")
    return y.view(*x.shape[:-1], y.shape[-1])
