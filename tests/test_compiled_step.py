"""When the decode step is compiled, and what a failing compiler leaves (the compiled step's
answers against eager are checked in test_fused)."""

from __future__ import annotations

import pytest
import torch

from braid.config import load_model_config
from braid.distributed.comm import SkipCommunicator
from braid.engine import compiled_step
from braid.engine.batch import ForwardBatch
from braid.engine.compiled_step import (
    WARM_UP_ROWS,
    CompiledDecodeStep,
    dynamo_bytecode,
    generated_function,
    inductor_config,
    step_compile_applies,
    warm_up_plans,
)
from braid.layers.quant import Quantizable
from braid.models.registry import model_class


@pytest.fixture(scope="module")
def tiny_model(model_path):
    """SmolLM2's layers, unloaded (only the structure is read), with a small KV cache (the
    model runner sizes it before it builds the compiled step)."""
    config = load_model_config(model_path)
    model = model_class(config)(config, SkipCommunicator(0, 1), torch.bfloat16)
    for attn in model.attention_layers():
        attn.allocate_cache(4, 16, torch.bfloat16, torch.device("cpu"))
    return model


def test_the_step_compiles_with_compile_on_for_one_cpu_rank(tiny_model):
    assert step_compile_applies("on", "cpu", 1, tiny_model)
    assert not step_compile_applies("auto", "cpu", 1, tiny_model)
    assert not step_compile_applies("off", "cpu", 1, tiny_model)
    assert not step_compile_applies("on", "cuda", 1, tiny_model)
    assert not step_compile_applies("on", "cpu", 2, tiny_model)  # collectives: not traceable


def test_gemm_kernels_chosen_by_weights_and_cpu(tiny_model, monkeypatch):
    """oneDNN alone for graphs of dense bf16 weights on a CPU without AMX; inductor's templates
    are timed against it with AMX or where the graph reads int8 weights."""
    def backends(flags: set[str], one_sequence: bool = True) -> str:
        monkeypatch.setattr(compiled_step, "cpu_flags", lambda: flags)
        return inductor_config(tiny_model, one_sequence)["max_autotune_gemm_backends"]

    no_amx, amx = {"avx512f", "avx512_bf16"}, {"avx512f", "avx512_bf16", "amx_bf16"}
    assert backends(no_amx) == backends(no_amx, one_sequence=False) == "ATEN"
    assert backends(amx) == "CPP,ATEN"
    some_linear = next(m for m in tiny_model.modules() if isinstance(m, Quantizable))
    monkeypatch.setattr(some_linear, "int8", object(), raising=False)
    assert backends(no_amx) == "CPP,ATEN"
    # the graph for several sequences reads the int8 weights only with AMX (int8_applies)
    for several_read_int8, expected in ((False, "ATEN"), (True, "CPP,ATEN")):
        monkeypatch.setattr(compiled_step, "INT8_GRAPH_AT_BATCH", several_read_int8)
        assert backends(no_amx, one_sequence=False) == expected


def test_warm_up_plans_are_decode_steps_in_block_zero():
    for block_size in (16, 4):
        plans = warm_up_plans(block_size)
        assert [p.num_tokens for p in plans] == [1, WARM_UP_ROWS]
        for plan in plans:
            batch = ForwardBatch(plan, block_size, "cpu")
            assert CompiledDecodeStep.handles(batch)
            assert (plan.slot_mapping < block_size).all() and (plan.block_tables == 0).all()


def test_a_failing_compiler_warns_and_leaves_decode_eager(tiny_model):
    step = CompiledDecodeStep(tiny_model, tiny_model.operations(), announce=False)

    def broken(batch):
        raise RuntimeError("no C++ compiler")

    step._forward = broken
    batches = [ForwardBatch(plan, 16, "cpu") for plan in warm_up_plans(16)]
    with pytest.warns(UserWarning, match="compiling the decode step failed.*no C.. compiler"):
        assert step.warm_up(batches) is False


def test_decode_block_tables_are_never_narrower_than_the_traced_width():
    """A 3-token sequence's decode step is padded to DECODE_MIN_BLOCKS blocks (masked), so the
    compiled graph's symbolic width serves it instead of compiling a graph for width 1."""
    from braid.engine.batch import DECODE_MIN_BLOCKS

    plan = warm_up_plans(16)[1]
    plan.kv_lens[:] = 3
    plan.block_tables = plan.block_tables[:, :1]
    meta = ForwardBatch(plan, 16, "cpu").attn_groups[0].meta
    assert meta.block_tables.shape == (WARM_UP_ROWS, DECODE_MIN_BLOCKS)
    assert meta.key_mask.shape[-1] == DECODE_MIN_BLOCKS * 16
    assert meta.key_mask.sum().item() == WARM_UP_ROWS * 3


def test_decode_block_tables_wider_than_the_keys_come_out_contiguous():
    """A plan whose tables hold more blocks than its keys fill is cut to the keys' width as a
    contiguous tensor: the graph, traced on contiguous tables and called without guards,
    rejected the strided slice ("expected size 32==32, stride 11==9")."""
    import numpy as np

    plan = warm_up_plans(16)[1]
    plan.kv_lens[:] = 20  # two blocks of 16
    plan.block_tables = np.arange(WARM_UP_ROWS * 5).reshape(WARM_UP_ROWS, 5)
    tables = ForwardBatch(plan, 16, "cpu").attn_groups[0].meta.block_tables
    assert tables.is_contiguous()
    assert tables.tolist() == plan.block_tables[:, :2].tolist()


def test_the_generated_code_runs_the_graph_without_dynamo():
    """What a warmed-up step calls: dynamo's code for the function, run with no guard check
    (an input dynamo would recompile for runs the same graph) and the same answer."""
    compiles = []

    def counting_backend(graph_module, example_inputs):
        compiles.append(graph_module)
        return graph_module.forward

    def scaled(x):
        return x * 2 + 1

    compiled = torch.compile(scaled, backend=counting_backend, dynamic=True)
    with dynamo_bytecode() as generated:
        compiled(torch.ones(3))
    direct = generated_function(generated, scaled)
    assert direct is not None and len(compiles) == 1
    x = torch.arange(5, dtype=torch.float64)  # another dtype: a guard dynamo would fail
    assert torch.equal(direct(x), x * 2 + 1)
    assert len(compiles) == 1
    assert generated_function(generated, test_warm_up_plans_are_decode_steps_in_block_zero) is None


def test_steps_go_through_dynamo_where_warm_up_generated_no_code(tiny_model):
    """A shape class whose warm-up produced no code of dynamo's (here: `_forward` is not
    compiled) runs through `_forward`, guards checked in full."""
    step = CompiledDecodeStep(tiny_model, tiny_model.operations(), announce=False)
    seen = []
    step._forward = lambda batch: seen.append(batch.num_tokens) or torch.zeros(1)
    batches = [ForwardBatch(plan, 16, "cpu") for plan in warm_up_plans(16)]
    assert step.warm_up(batches) is True
    for batch in batches:
        step(batch)
    assert seen == [1, WARM_UP_ROWS] * 2


def test_other_errors_of_the_step_propagate(tiny_model):
    step = CompiledDecodeStep(tiny_model, tiny_model.operations(), announce=False)
    step._forward = lambda batch: torch.zeros(1)
    batch = ForwardBatch(warm_up_plans(16)[0], 16, "cpu")
    step.warm_up([batch])

    def broken(batch):
        raise RuntimeError("out of memory")

    step._forward = broken
    with pytest.raises(RuntimeError, match="out of memory"):
        step(batch)


def test_decode_attention_uses_the_kernel_where_the_cache_fits_it(tiny_model):
    """The C++ decode operator reads the tokens-innermost layout the compiled step allocates;
    a token-major cache keeps the traced kernel."""
    layers = tiny_model.attention_layers()
    compiled_step.use_decode_kernels(tiny_model)  # the fixture's caches are token-major
    assert not any(attn.use_decode_kernel for attn in layers)
    try:
        for attn in layers:
            attn.allocate_cache(4, 16, torch.bfloat16, torch.device("cpu"), tokens_innermost=True)
        compiled_step.use_decode_kernels(tiny_model)
        assert all(attn.use_decode_kernel for attn in layers)
    finally:
        for attn in layers:
            attn.allocate_cache(4, 16, torch.bfloat16, torch.device("cpu"))
            attn.use_decode_kernel = False


needs_avx512_bf16 = pytest.mark.skipif("avx512_bf16" not in compiled_step.cpu_flags(),
                                       reason="the GEMV operator needs AVX512-BF16")


@needs_avx512_bf16
@pytest.mark.parametrize("rows, columns", [(3072, 576), (45, 64), (7, 1536), (13, 96)])
def test_the_gemv_operator_matches_the_reference(rows, columns):
    """One row against a row-major weight, bf16 or int8 with scales, against the fp64
    product: 8 rows at a time, then the remainder (45, 7, 13) one by one; int8 rows a cache
    line at a time, then the rest of a row (96) in chunks."""
    from braid.layers import decode_kernel
    from braid.layers.quant import Int8Weight

    assert decode_kernel.load()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, columns, generator=gen).to(torch.bfloat16)
    weight = torch.randn(rows, columns, generator=gen).to(torch.bfloat16)
    int8 = Int8Weight.quantize(weight)
    assert decode_kernel.gemv_fits(weight) and decode_kernel.gemv_fits(int8.values)
    for out, dense in ((decode_kernel.gemv(x, weight), weight.double()),
                       (decode_kernel.gemv(x, int8.values, int8.scales),
                        int8.dequantize().double())):
        assert out.dtype == torch.bfloat16 and out.shape == (1, rows)
        # fp32 sums rounded once to bf16 (2^-8 relative) at the end
        torch.testing.assert_close(out.double(), x.double() @ dense.t(),
                                   atol=1e-3 * columns ** 0.5, rtol=2 ** -8)


@needs_avx512_bf16
def test_the_gemv_operator_refuses_what_it_does_not_compute():
    from braid.layers import decode_kernel

    assert decode_kernel.load()
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one input row"):
        decode_kernel.gemv(torch.zeros(2, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        decode_kernel.gemv(torch.zeros(1, 48, dtype=torch.bfloat16), weight[:, :48].clone())
    with pytest.raises(RuntimeError, match="a bf16 scale per output row"):
        decode_kernel.gemv(torch.zeros(1, 64, dtype=torch.bfloat16),
                           torch.zeros(8, 64, dtype=torch.int8), torch.ones(4))
    assert not decode_kernel.gemv_fits(weight.float())
    assert not decode_kernel.gemv_fits(weight.t())
    assert not decode_kernel.gemv_fits(torch.zeros(8, 40, dtype=torch.int8))


@needs_avx512_bf16
def test_one_row_products_in_a_compiled_graph_take_the_gemv(tiny_model):
    """The linear layers' one-row products take the operator when traced, several rows keep
    the dense GEMM; the results agree with eager."""
    from braid.layers.quant import linear

    compiled_step.use_decode_kernels(tiny_model)
    assert all(m.gemv for m in tiny_model.modules() if isinstance(m, Quantizable))
    weight = torch.randn(96, 64).to(torch.bfloat16)
    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes})
        return gm.forward

    @torch.compile(backend=record, fullgraph=True, dynamic=False)
    def product(x):
        return linear(x, weight, gemv=True)

    for rows in (1, 3):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        torch.testing.assert_close(product(x), linear(x, weight), atol=2e-2, rtol=2 ** -7)
    assert ["braid.gemv_bf16" in targets for targets in graphs] == [True, False]
