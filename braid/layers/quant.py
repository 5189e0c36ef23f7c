"""The weight forms a linear layer's GEMM reads, made at load time from any checkpoint.

**Packed bf16 (CPU; by default with AMX).** Each bf16 linear weight also gets oneDNN's blocked
copy, which GEMMs of at most the rank's `KernelPlan.packed_max_rows` rows read (past the few-row
kernel's): they no longer reorder the weight on every call, with bit-identical results. With
AMX, larger GEMMs read the row-major weight, which is kept: AMX's GEMM reorders it faster than
it reads the blocked copy. The copy costs the weights' bytes again, so without AMX (where it
tied the row-major GEMMs past the few-row kernel's rows) `--weight-packing auto` makes none.
fp32 keeps the row-major weights only (oneDNN's packed fp32 GEMM was not faster). A SwiGLU's
merged gate/up weight is packed as its two halves instead, and `gated_silu` applies SiLU and the
product in the two GEMMs' oneDNN epilogues: no pass over the activation. Figures:
docs/kernel-choices.md, "Weights". Packed weights are oneDNN's opaque tensors, which compiled
graphs cannot take as inputs, so the GEMM over one is braid's operator `packed_linear`
(`csrc/packed_linear.cpp`), which finds the weight by its number in a table of the process (a
one-element tensor, so that one graph serves every layer): eager steps and compiled graphs
(their GEMMs of few rows) call the same operator.

**GGUF blocks (`--quantization auto`).** A layer whose weight a GGUF file stores in quantized
blocks keeps only those (`Quantizable.ggml`, `braid.layers.ggml_weight`): `apply_linear`
computes from them and none of the forms here is made. `--quantization int4` and `int8` give
the dense linear weights such blocks at load (`braid.layers.weight_rounding`).

**Few rows (`--few-row-gemm`).** GEMMs of up to the plan's `few_rows` rows (decode, speculative
verification) run braid's kernel over the row-major bf16 or fp32 weight
(`decode_kernel.few_rows_linear`), which streams the weight once for every row and computes
each output alike whatever the row count; larger ones take the packed weight or ATen. The choice
is made by `linear_by_rows` in C++, as a compiled graph's row count is a symbol.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from braid import native
from braid.layers import decode_kernel
from braid.layers.fused import silu_mul
from braid.layers.ggml_weight import GGMLWeight
from braid.layers.kernel_plan import KernelPlan


class Quantizable:
    """Mixin of the layers whose weight `make_weight_forms` gives other forms; `forward` passes
    them all to `linear` (`apply_linear`)."""

    # The weight in a GGUF file's quantized blocks, computed from as they are (the dense
    # parameter then holds no memory: `ggml_weight.keep_blocks`)
    ggml: GGMLWeight | None = None
    # The number oneDNN's blocked copy of the weight (kept beside the row-major one) is
    # registered under for `packed_linear` (`pack_linear_layers`), as a one-element tensor
    packed: torch.Tensor | None = None
    # False where other code reads the weight as a matrix (MLA's kv_b_proj)
    packable = True
    # GEMMs of at most this many rows read `packed` (None: of any number)
    packed_rows: int | None = None
    # GEMMs of at most this many rows run braid's few-row kernel over the row-major weight
    # (`decode_kernel.few_rows_linear`); 0 where the plan or the weight rules it out
    few_rows = 0
    # Set on a SwiGLU's merged [gate | up] projection (`GatedMLP`): packing then makes
    # `packed_halves`, gate and up packed apart (their two numbers in one tensor), for
    # `gated_silu` (and no merged copy)
    gated = False
    packed_halves: torch.Tensor | None = None

    def quantizable_weight(self) -> torch.Tensor:
        return self.weight

    def apply_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ weight.T (+ bias)` through the form `linear` picks for `x` (the GGML blocks
        where the weight is kept so)."""
        if self.ggml is not None:
            y = self.ggml.linear(x)
            return y if bias is None else y + bias
        return linear(x, self.quantizable_weight(), bias, self.packed, self.few_rows,
                      self.packed_rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, few_rows: int = 0,
           packed_rows: int | None = None) -> torch.Tensor:
    """`F.linear`, with `few_rows` through `linear_by_rows`, which runs braid's few-row kernel
    up to that many rows and the packed weight numbered `packed` (up to `packed_rows` rows) or
    ATen beyond; else through the packed weight where there is one and `packed_applies`."""
    if few_rows:
        y = _by_rows(x, weight, packed, few_rows, packed_rows, swiglu=False)
        return y if bias is None else y + bias
    if packed is not None and packed_applies(x, packed_rows):
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.braid.packed_linear(rows, packed, weight.shape[0], bias, "none", None)
        return y.view(*x.shape[:-1], y.shape[-1])
    return F.linear(x, weight, bias)


def _by_rows(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, few_rows: int,
             packed_rows: int | None, swiglu: bool) -> torch.Tensor:
    """`linear_by_rows` over `x`'s rows (`csrc/gemv.cpp`): the row count is decided there, as
    a compiled graph's is a symbol that a Python branch would fix at its traced value."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.braid.linear_by_rows(rows, weight, packed, few_rows,
                                       -1 if packed_rows is None else packed_rows, swiglu)
    return y.view(*x.shape[:-1], y.shape[-1])


def make_weight_forms(model: nn.Module, kernels: KernelPlan) -> bool:
    """Give the model's linear layers (the LM head included) the weight forms the rank's
    plan asks for, once its weights are loaded and on their device: oneDNN's packed copies
    (for GEMMs of up to `kernels.packed_max_rows` rows) and the few-row kernel where a layer's
    weight fits it. Whether any weight was packed."""
    layers = [m for m in model.modules() if isinstance(m, Quantizable) and m.ggml is None]
    packed = kernels.packed_weights and pack_linear_layers(model, kernels.packed_max_rows)
    for layer in layers:
        fits = decode_kernel.few_rows_fits(layer.quantizable_weight())
        layer.few_rows = kernels.few_rows if fits else 0
    return packed


# The row count oneDNN lays the blocks out for (packing for a step's exact row count was no faster)
PACK_HINT_ROWS = 256


def packed_applies(x: torch.Tensor, max_rows: int | None) -> bool:
    """Whether a GEMM of `x` reads the packed weights where a layer has them: up to `max_rows`
    rows (None: any number)."""
    return max_rows is None or x.numel() <= max_rows * x.shape[-1]


def packing_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed: bf16 on a CPU whose oneDNN computes bf16."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_layers(model: nn.Module, max_rows: int | None) -> bool:
    """Give the bf16 weight of every packable linear layer oneDNN's blocked copy, for GEMMs of
    up to `max_rows` rows (None: any; the row-major weight stays for larger ones), registered
    for `packed_linear` (forgotten when `model` is). Other dtypes and devices stay as they are.
    Whether any weight was packed."""
    if not native.load():
        return False
    ids = []

    def register(weight: torch.Tensor) -> torch.Tensor:
        ids.append(torch.ops.braid.register_packed_weight(_pack(weight)))
        return torch.tensor([ids[-1]], dtype=torch.int64)

    for layer in model.modules():
        if not isinstance(layer, Quantizable) or not layer.packable or layer.ggml is not None:
            continue
        weight = layer.quantizable_weight()
        if not packing_supported(weight):
            continue
        if layer.gated:
            layer.packed_halves = torch.cat([register(half.contiguous())
                                             for half in weight.chunk(2)])
        else:
            layer.packed = register(weight)
        layer.packed_rows = max_rows
    if ids:
        weakref.finalize(model, torch.ops.braid.forget_packed_weights, ids)
    return bool(ids)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)


def swiglu(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a merged [gate | up] projection (`Quantizable.gated`), through the
    weight form `linear` would read, the activation applied by the C++ operator where ATen does
    not compute the product: by rows (`linear_by_rows`) with the few-row kernel, else the packed
    halves (`gated_silu`) where they apply; otherwise the layer's product and `silu_mul`."""
    if layer.few_rows:
        return _by_rows(x, layer.weight, layer.packed_halves, layer.few_rows, layer.packed_rows,
                        swiglu=True)
    if layer.packed_halves is not None and packed_applies(x, layer.packed_rows):
        return gated_silu(x, layer.packed_halves, layer.weight.shape[0] // 2)
    return silu_mul(layer(x))


def gated_silu(x: torch.Tensor, halves: torch.Tensor, columns: int) -> torch.Tensor:
    """`silu(x @ gate.T) * (x @ up.T)` for the packed gate and up (the two numbers of
    `halves`, of `columns` outputs each): two oneDNN GEMMs, the first applying SiLU to its fp32
    sums, the second multiplying its sums by the first's output, so neither the merged
    projection nor the activation is another pass over memory (faster than the merged GEMM and
    the compiled `silu_mul` at prefill sizes: docs/kernel-choices.md, "Packed bf16 weights")."""
    rows = x.reshape(-1, x.shape[-1])
    activated = torch.ops.braid.packed_linear(rows, halves[:1], columns, None, "swish", None)
    y = torch.ops.braid.packed_linear(rows, halves[1:], columns, None, "mul", activated)
    return y.view(*x.shape[:-1], y.shape[-1])
