"""Compressed partial sums (`--comm-compression`): the error of an int8 sum is bounded against
the exact one, every rank gets the same bits, and the C++ packing matches the ATen one."""

from __future__ import annotations

import pytest
import rank_targets
import torch

from braid.distributed import compression
from braid.distributed.ranks.local import LocalRankGroup


def partial_sums(ranks: int, dtype: torch.dtype, shape=(300, 576)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # a few large channels, as real activations have: their blocks quantize more coarsely
    outliers = 1 + 30 * (torch.rand(shape[-1], generator=g) > 0.98)
    return [(torch.randn(shape, generator=g) * outliers).to(dtype) for _ in range(ranks)]


def gathered(partials: list[torch.Tensor], kind: str) -> torch.Tensor:
    return torch.cat([compression.pack(x.contiguous(), kind) for x in partials])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 576), (7, 100)])  # 100: a block padded with zeros
def test_int8_sum_error_is_bounded_and_halves_the_bytes(dtype, shape):
    partials = partial_sums(2, dtype, shape)
    total = compression.unpack_sum(gathered(partials, "int8"), "int8", 2, partials[0])
    exact = sum(x.float() for x in partials)
    error = (total.float() - exact).abs()
    assert total.dtype == dtype and total.shape == partials[0].shape
    assert (error <= compression.max_error(partials)).all()
    assert error.max() > 0  # it is lossy: the bound is what holds
    bf16_bytes = partials[0].numel() * 2
    if shape[-1] % compression.BLOCK == 0:
        assert compression.pack(partials[0], "int8").numel() <= 0.54 * bf16_bytes


@pytest.mark.parametrize("path", ["cpp", "aten"])
def test_a_block_with_nan_or_inf_sums_to_nan(monkeypatch, path):
    """Its int8 values would be undefined (a float's conversion out of range): they are 0 and
    its scale NaN, on both packings; the other blocks are untouched."""
    from braid import native

    if path == "aten":
        monkeypatch.setattr(compression, "_uses_native", lambda x: False)
    elif not native.load():
        pytest.skip("braid's C++ operators are not built on this host")
    x = torch.ones(4, compression.BLOCK)
    x[1, 5], x[2, 0] = float("nan"), float("inf")
    packed = compression.pack(x, "int8")
    assert (packed[:x.numel()].view(4, -1)[1:3] == 0).all()
    total = compression.unpack_sum(torch.cat([packed, packed]), "int8", 2, x)
    assert total[1:3].isnan().all()
    torch.testing.assert_close(total[[0, 3]], 2 * x[[0, 3]])


def test_residual_is_added_after_the_sum():
    partials = partial_sums(3, torch.float32)
    residual = torch.randn(partials[0].shape)
    packed = gathered(partials, "int8")
    with_residual = compression.unpack_sum(packed, "int8", 3, partials[0], residual)
    alone = compression.unpack_sum(packed, "int8", 3, partials[0])
    torch.testing.assert_close(with_residual, alone + residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_packing_equals_aten(monkeypatch, dtype):
    from braid import native

    if not native.load():
        pytest.skip("braid's C++ operators are not built on this host")
    partials = partial_sums(2, dtype)
    cpp = gathered(partials, "int8")
    cpp_sum = compression.unpack_sum(cpp, "int8", 2, partials[0])
    monkeypatch.setattr(compression, "_uses_native", lambda x: False)
    aten = gathered(partials, "int8")
    assert torch.equal(cpp, aten)
    # the sums differ only by fp32 rounding (the compiler may fuse the multiply-add)
    torch.testing.assert_close(cpp_sum, compression.unpack_sum(aten, "int8", 2, partials[0]))


def test_bf16_compression_rounds_fp32_sums():
    partials = partial_sums(2, torch.float32)
    total = compression.unpack_sum(gathered(partials, "bf16"), "bf16", 2, partials[0])
    rounded = sum(x.bfloat16().float() for x in partials)
    torch.testing.assert_close(total, rounded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_a_packing_never_shares_the_partial_sums_memory(kind, dtype):
    """gloo reads the packing from its own thread until the wait, while the step goes on
    with the partial sum: a bf16 partial sum packed to bf16 is copied too."""
    x = partial_sums(1, dtype)[0]
    packed = compression.pack(x, kind)
    assert packed.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_ranks_get_identical_compressed_sums_over_gloo(kind):
    group = LocalRankGroup(2, rank_targets.compressed_sums, (kind,))
    try:
        (sums0, partials), (sums1, _) = group.gather(timeout=120)
    finally:
        group.close()
    for a, b in zip(sums0, sums1):
        assert torch.equal(a, b)  # the same bits on every rank: activations stay in step
    # sums: the bf16 pair's, then the fp32 pair's plus a residual of ones
    fp32, bf16 = [partials[0], partials[2]], [partials[1], partials[3]]
    exact = sum(x.float() for x in fp32) + 1
    if kind == "int8":
        assert ((sums0[0].float() - sum(x.float() for x in bf16)).abs()
                <= compression.max_error(bf16)).all()
        assert ((sums0[1] - exact).abs() <= compression.max_error(fp32)).all()
    else:
        torch.testing.assert_close(sums0[1], sum(x.bfloat16().float() for x in fp32) + 1)


def test_overlap_runs_with_compressed_sums_and_auto_probes_the_pair():
    """Refused while gloo's race (docs/gloo-race.md) crashed served runs with both."""
    from braid.config import EngineConfig
    from braid.engine.step_choice import step_settings

    config = EngineConfig.create(model="m", tp=2, comm="torch", overlap="on",
                                 comm_compression="int8")
    assert step_settings(config.switches, 512, 2, False, False) == [
        (("overlap", True), ("compression", "int8"))]
    learned = EngineConfig.create(model="m", tp=2, comm="torch").switches
    assert (("overlap", True), ("compression", "int8")) in step_settings(
        learned, 512, 2, False, compression_learned=True)


def test_auto_does_not_probe_overlap_for_a_decode_step_that_a_graph_runs():
    """Its first overlapped step would compile pieces mid-serving (a 0.5-6 s stall seen in a
    speculative verification's 17 rows); `--overlap on` still overlaps such a step."""
    from braid.config import EngineConfig
    from braid.engine.step_choice import step_settings

    learned = EngineConfig.create(model="m", tp=2).switches
    overlap = {dict(s)["overlap"] for s in step_settings(learned, 17, 2, False, False,
                                                          graph_decode=True)}
    assert overlap == {False}
    assert {dict(s)["overlap"] for s in step_settings(learned, 17, 2, False, False)} == {
        False, True}
    forced = EngineConfig.create(model="m", tp=2, overlap="on").switches
    assert {dict(s)["overlap"] for s in step_settings(forced, 17, 2, False, False,
                                                      graph_decode=True)} == {True}
