"""`--compile`: the compiled elementwise kernels equal the eager ones, small steps stay eager,
a failing compiler falls back, and a compiled model answers as the eager one does."""

from __future__ import annotations

import pytest
import torch
from conftest import slow

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_equal_eager(kernels, dtype):
    fused.configure_compile("on")
    assert kernels.compiled is not None, "torch.compile failed on this host"
    kernels.native = False  # the compiled norm, as where the C++ one is not built (CUDA, fp16)
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


def test_the_pair_sum_rounds_once_with_or_without_the_native_operator(kernels):
    """Ranks sum block partials and the residual with it: one rounding of the fp32 sum, the
    same bits from the C++ operator (any row count, vector tails) and from the formula."""
    fused.configure_compile("off")
    assert kernels.native, "decode_kernel's library did not build on this host"
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((1, 576), (32, 576), (3, 100), (1500, 576)):
            a, b, residual = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(3))
            once = (a.double() + b.double() + residual.double()).to(dtype)
            kernels.native = True
            native = fused.add_pair(a, b, residual)
            kernels.native = False
            assert torch.equal(native, fused.add_pair(a, b, residual))
            if dtype == torch.bfloat16:  # fp32 sums of bf16 terms: exact before the rounding
                assert torch.equal(native, once)


def test_weights_a_frozen_graph_has_read_share_one_compiled_norm(kernels):
    """Freezing (the compiled decode step) marks the parameters it reads as guarded
    constants; the prompt steps' norms must still share one graph across layers."""
    fused.configure_compile("on")
    kernels.native = False  # the compiled norm, as where the C++ one is not built (CUDA, fp16)
    x = torch.randn(fused.COMPILED_MIN_TOKENS, 576).bfloat16()
    weights = [torch.nn.Parameter(torch.randn(576).bfloat16(), requires_grad=False)
               for _ in range(3)]
    for weight in weights:
        torch._dynamo.mark_static_address(weight, guard=True)  # what freezing leaves behind
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
    fused.configure_compile("off")
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
    fused.configure_compile("off")
    assert kernels.pick("rms_norm", 4096) is eager
    fused.configure_compile("auto")
    assert kernels.pick("rms_norm", fused.COMPILED_MIN_TOKENS - 1) is eager
    assert kernels.compiled is None  # auto compiles only when a large step needs it
    fused.configure_compile("auto", device="cuda")
    assert kernels.pick("rms_norm", 4096) is eager


def test_a_failing_compiler_warns_and_stays_eager(kernels, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(UserWarning, match="torch.compile failed.*no C.. compiler.*running eager"):
        fused.configure_compile("on")
    assert kernels.pick("rotate", 4096) is fused._rotate


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer) -> str:
    from braid.random_model import make_random_model

    folder = tmp_path_factory.mktemp("tiny-llama") / "model"
    return str(make_random_model("llama", "tiny", str(folder), tokenizer=tokenizer))


# The embedded model's decode step autotunes for minutes in fp32: the default suite runs the
# same checks on a random two-layer Llama.
@pytest.mark.parametrize("model, kv_cache_dtype", [
    ("tiny_llama", "auto"), slow("tiny_llama", "int8"), slow("model_path", "auto")])
def test_a_compiled_model_answers_as_the_eager_one(model, kv_cache_dtype, request, capfd):
    """300 prompt tokens take the compiled kernels, and the decode steps the compiled step
    (`--compile on`: one graph for one sequence, one for several, a short prompt's padded
    block table included); logits and greedy tokens match eager (fp32, where both compute the
    same sums). With an int8 KV cache, eager decode attends over the dequantized blocks and
    the compiled step's C++ operator over the int8 ones with their scales."""
    from braid import LLM, SamplingParams

    model_path = request.getfixturevalue(model)

    prompt = [list(range(500, 800))]
    several = [list(range(600 + 7 * i, 640 + 13 * i)) for i in range(3)] + [[5, 6, 7]]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    results = {}
    for mode in ("off", "on"):
        with LLM(model_path, dtype="fp32", compile=mode, kv_cache_dtype=kv_cache_dtype) as llm:
            results[mode] = (llm.prompt_logits(prompt)[0],
                             llm.generate([prompt[0]], params)[0].token_ids,
                             [out.token_ids for out in llm.generate(several, params)])
    assert "decode step compiled" in capfd.readouterr().err
    assert results["on"][1] == results["off"][1]
    assert results["on"][2] == results["off"][2]
    assert (results["on"][0] - results["off"][0]).abs().max() < 1e-3
