"""Elementwise work (RMSNorm and rotary, which every rank repeats in full, and SiLU-and-multiply),
eager or fused by `torch.compile` (`--compile`).

Eager PyTorch runs each of these as several passes over memory (RMSNorm: convert, square,
mean, scale, convert, weight); compiled, each is one loop, several times faster at prefill
sizes, which matters most under tensor parallelism: the ranks split the GEMMs but not this
work. For a few tokens a compiled call's dispatch costs more than it saves, so steps below
`COMPILED_MIN_TOKENS` rows stay eager. Where `decode_kernel`'s C++ library is built (CPU),
RMSNorm is its one-pass operator instead, at any number of rows (`rms_norm`). Figures:
docs/kernel-choices.md, "Elementwise work".

Modes (the rank's `KernelPlan.fused_elementwise`): `off` never compiles; `on` compiles when the
rank starts (a few seconds, announced); `auto` compiles the first time a step is large enough,
so short jobs never pay for it.
A compiler that fails (no C++ toolchain, say) warns once and leaves everything eager.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from braid.compiler import configure_compiler

COMPILED_MIN_TOKENS = 128  # measured crossover of a compiled call's overhead (see docstring)
# The dtypes `decode_kernel`'s elementwise operators take
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`_rms_norm` through ATen's one-pass kernel (4 ops instead of 7: half the time at a
    decode step's few rows); the compiler gets the plain formula, which it fuses."""
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            interleaved: bool) -> torch.Tensor:
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _rotate_by_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      interleaved: bool) -> torch.Tensor:
    """`_rotate` for the compiler, the same bits: each rotated half is written into its place
    of the output instead of joined by `cat`, whose compiled form was the slower. Eager keeps
    `_rotate`, one op fewer and the faster there."""
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    o1.copy_(x1 * cos - x2 * sin)
    o2.copy_(x2 * cos + x1 * sin)
    return out


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_EAGER: dict[str, Callable] = {"rms_norm": _rms_norm_eager, "rotate": _rotate,
                               "silu_mul": _silu_mul}
_TO_COMPILE: dict[str, Callable] = {**_EAGER, "rms_norm": _rms_norm, "rotate": _rotate_by_halves}


class _Kernels:
    """Which implementation each function runs; one per process (a rank)."""

    def __init__(self) -> None:
        self.mode = "off"
        self.announce = False
        self.compiled: dict[str, Callable] | None = None
        self.failed = False
        self.native = False  # whether braid's C++ operators are built (CPU)

    def configure(self, mode: str, native: bool, announce: bool) -> None:
        self.mode = mode
        self.announce = announce
        self.native = native
        if self.mode == "on" and self.compiled is None:  # (a draft model's runner: compiled)
            self._compile()

    def pick(self, name: str, rows: int) -> Callable:
        if torch.compiler.is_compiling():  # inside a compiled step: the fusable formula
            return _TO_COMPILE[name]
        if self.mode == "off" or self.failed or rows < COMPILED_MIN_TOKENS:
            return _EAGER[name]
        if self.compiled is None:
            self._compile()
        return self.compiled[name] if self.compiled else _EAGER[name]

    def _compile(self) -> None:
        """Compile every function and run it once (dynamic shapes: one graph for all token
        counts); on any failure, warn and stay eager."""
        if self.announce:
            print("braid: compiling fused elementwise kernels (torch.compile, once per "
                  "process; --compile off skips this)", file=sys.stderr, flush=True)
        configure_compiler()
        try:
            compiled = {name: torch.compile(fn, dynamic=True)
                        for name, fn in _TO_COMPILE.items()}
            _warm_up(compiled, norm=not self.native)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run eager
            warnings.warn(f"--compile: torch.compile failed ({type(e).__name__}: {e}); "
                          "running eager", stacklevel=2)
            self.failed = True
            return
        self.compiled = compiled


def _warm_up(compiled: dict[str, Callable], norm: bool) -> None:
    """One call per function and dtype the engine uses, so no step pays for compilation;
    the norm only where `rms_norm` does not take the C++ operator (a compiled function is
    compiled at its first call)."""
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(COMPILED_MIN_TOKENS, 4, 8).to(dtype)
            angle = torch.randn(COMPILED_MIN_TOKENS, 1, 4)
            if norm:
                compiled["rms_norm"](x[:, 0], torch.ones(8, dtype=dtype), 1e-6)
            for interleaved in (False, True):
                compiled["rotate"](x, angle.cos(), angle.sin(), interleaved)
            compiled["silu_mul"](x[:, 0])


_kernels = _Kernels()


def configure_compile(mode: str, native: bool, announce: bool = False) -> None:
    """Set this process's mode (`KernelPlan.fused_elementwise`: `on` compiles now) and whether
    braid's C++ operators are loaded (`native`: the norm is then theirs); `announce` prints a
    line when compiling starts (rank 0 does)."""
    _kernels.configure(mode, native, announce)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)`, computed in fp32 and cast back (as Hugging Face Llama does).

    Eager on CPU, for float32 and bf16, this is braid's C++ operator (`csrc/rms_norm.cpp`, one
    pass per row, rounded once as the compiled formula is) at any number of rows: faster than
    eager and than the compiled kernel at every size measured. In a compiled graph inductor
    fuses the formula with its neighbours instead."""
    if not torch.compiler.is_compiling() and _native_fits(x, weight):
        return torch.ops.braid.rms_norm(x.contiguous(), weight, eps)
    return _kernels.pick("rms_norm", x.shape[0])(x, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """Rotary embedding of `x` ([tokens, heads, dim]) in fp32: halves rotated (neox), or
    interleaved pairs laid out as [evens rotated, odds rotated]."""
    return _kernels.pick("rotate", x.shape[0])(x, cos, sin, interleaved)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a merged [tokens, 2 * columns] projection."""
    return _kernels.pick("silu_mul", gate_up.shape[0])(gate_up)


def _native_fits(*tensors: torch.Tensor) -> bool:
    """Whether braid's C++ elementwise operators take these tensors: built, on CPU,
    float32 or bf16, all of one dtype."""
    first = tensors[0]
    return (_kernels.native and first.device.type == "cpu" and first.dtype in _NATIVE_DTYPES
            and all(t.dtype == first.dtype for t in tensors))
