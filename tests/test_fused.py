"""`--compile`: the compiled elementwise kernels equal the eager ones, small steps stay eager,
a failing compiler falls back, and a compiled model answers as the eager one does."""

from __future__ import annotations

import pytest
import torch

from braid import native
from braid.layers import fused


@pytest.fixture
def kernels():
    """This process's kernel choice, restored afterwards."""
    saved = fused._kernels
    fused._kernels = fused._Kernels()
    try:
        yield fused._kernels
    finally:
        fused._kernels = saved


@pytest.mark.slow  # compiles; make test's compiled steps: test_compiled_parity
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_equal_eager(kernels, dtype):
    # the compiled norm, as where the C++ one is not built (CUDA, fp16)
    fused.configure_compile("on", native=False)
    assert kernels.compiled is not None, "torch.compile failed on this host"
    gen = torch.Generator().manual_seed(0)
    for rows in (fused.COMPILED_MIN_TOKENS, 300):
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        weight = torch.randn(576, generator=gen).to(dtype)
        heads = torch.randn(rows, 5, 64, generator=gen).to(dtype)
        angle = torch.randn(rows, 1, 32, generator=gen)
        # bf16: one rounding of the fused product instead of two may move the last bit
        tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5),
                                   fused._rms_norm(x, weight, 1e-5), atol=tolerance,
                                   rtol=tolerance)
        for interleaved in (False, True):
            torch.testing.assert_close(
                fused.rotate(heads, angle.cos(), angle.sin(), interleaved),
                fused._rotate(heads, angle.cos(), angle.sin(), interleaved),
                atol=tolerance, rtol=tolerance)
        gate_up = torch.randn(rows, 2 * 96, generator=gen).to(dtype)
        torch.testing.assert_close(fused.silu_mul(gate_up), fused._silu_mul(gate_up),
                                   atol=tolerance, rtol=tolerance)


def test_weights_marked_static_share_one_compiled_norm(kernels):
    """The compiled steps mark the model's tensors static (`compiled_step.mark_static`); the
    norms of steps that run eager (compiled elementwise) must still share one graph across
    layers."""
    # the compiled norm, as where the C++ one is not built (CUDA, fp16)
    fused.configure_compile("on", native=False)
    x = torch.randn(fused.COMPILED_MIN_TOKENS, 576).bfloat16()
    weights = [torch.nn.Parameter(torch.randn(576).bfloat16(), requires_grad=False)
               for _ in range(3)]
    for weight in weights:
        torch._dynamo.mark_static(weight)
    frames = torch._dynamo.utils.counters["frames"]
    with torch.inference_mode():
        compiled = []
        for weight in weights:
            torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5),
                                       fused._rms_norm(x, weight, 1e-5), atol=2 ** -7,
                                       rtol=2 ** -7)
            compiled.append(frames["ok"])
    assert compiled[0] == compiled[-1], "each layer's norm weight compiled its own graph"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_eager_rms_norm_equals_the_formula(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 576, generator=gen).to(dtype) * 3
    weight = torch.randn(576, generator=gen).to(dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(fused._rms_norm_eager(x, weight, 1e-5),
                               fused._rms_norm(x, weight, 1e-5), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_rms_norm_equals_the_formula(kernels, dtype):
    """On CPU every norm outside a compiled graph is the C++ operator, at any row count, with
    vector tails (a width of 100) and leading dims (per-head norms)."""
    fused.configure_compile("off", native=native.load())
    assert kernels.native, "decode_kernel's library did not build on this host"
    gen = torch.Generator().manual_seed(3)
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
    for shape in ((1, 576), (32, 576), (7, 100), (5, 3, 64), (2048, 576)):
        x = torch.randn(*shape, generator=gen).to(dtype) * 3
        weight = torch.randn(shape[-1], generator=gen).to(dtype)
        out = fused.rms_norm(x, weight, 1e-5)
        assert torch.equal(out, torch.ops.braid.rms_norm(x, weight, 1e-5))
        torch.testing.assert_close(out, fused._rms_norm(x, weight, 1e-5), atol=tolerance,
                                   rtol=tolerance)


def test_small_steps_and_off_stay_eager(kernels):
    eager = fused._rms_norm_eager
    fused.configure_compile("off", native=False)
    assert kernels.pick("rms_norm", 4096) is eager
    fused.configure_compile("auto", native=False)
    assert kernels.pick("rms_norm", fused.COMPILED_MIN_TOKENS - 1) is eager
    assert kernels.compiled is None  # auto compiles only when a large step needs it


def test_a_failing_compiler_warns_and_stays_eager(kernels, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(UserWarning, match="torch.compile failed.*no C.. compiler.*running eager"):
        fused.configure_compile("on", native=False)
    assert kernels.pick("rotate", 4096) is fused._rotate
