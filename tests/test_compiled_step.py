"""Compiled steps: where they apply, how a step's operation list becomes pieces, the decode
graph saved and loaded, and the operators inside graphs (the compiled model's answers against
eager and transformers are checked in test_fused and test_hf_parity)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from braid.config import EngineConfig
from braid.distributed.comm import SkipCommunicator
from braid.engine.core import auto_compile_pays
from braid.layers import decode_kernel, kv_layout
from braid.layers.forward_batch import ForwardBatch
from braid.loader.model_config import load_model_config
from braid.models.registry import model_class
from braid.overlap.operations import YIELD
from braid.platform import cpu_flags
from braid.worker import compiled_step
from braid.worker.compiled_step import (
    WARM_UP_ROWS,
    CompiledDecodeStep,
    CompiledPieces,
    warm_up_plans,
)
from braid.worker.kernels import compile_applies, plan_kernels


@pytest.fixture(scope="module")
def tiny_model(model_path):
    """SmolLM2's layers, unloaded (only the structure is read), with a small KV cache (the
    model runner sizes it before it builds the compiled step)."""
    config = load_model_config(model_path)
    model = model_class(config)(config, SkipCommunicator(0, 1), torch.bfloat16)
    for attn in model.attention_layers():
        attn.allocate_cache(4, 16, torch.bfloat16, torch.device("cpu"))
    return model


def test_steps_compile_on_cpu_for_paged_attention_models(tiny_model):
    assert compile_applies("cpu", tiny_model) is None
    assert "CPU" in compile_applies("cuda", tiny_model)


def test_the_operation_list_becomes_pieces_between_attention_calls(tiny_model):
    """Straight: one piece from each layer's output projection to the next layer's qkv, the
    yields dropped; staged (two-batch overlap): pieces end at the yields too. A piece's graph is
    keyed by its functions, so the 30 layers share 3 graphs straight, 4 staged (the logits,
    whose rows vary by step, stay eager)."""
    pieces = CompiledPieces(tiny_model.operations())
    names = [getattr(op, "__name__", op) for op in pieces.plain]
    assert names[:4] == ["embed_op+qkv_op", "attend_op", "attention_output_op+mlp_op+qkv_op",
                         "attend_op"]
    assert names[-3:] == ["attend_op", "attention_output_op+mlp_op", "logits_op"]
    assert YIELD not in pieces.plain
    staged = [getattr(op, "__name__", op) for op in pieces.staged]
    assert staged[:6] == ["embed_op+qkv_op", "attend_op", "attention_output_op", YIELD,
                          "mlp_op", YIELD]
    assert staged[-2:] == ["logits_op", YIELD]
    assert pieces.kinds == 3 + 4 - 1  # the first piece is the same in both


def test_compile_pays_for_long_jobs_and_sooner_when_saved():
    assert not auto_compile_pays(8, cached=True)
    assert auto_compile_pays(1024, cached=True)
    assert not auto_compile_pays(1024, cached=False)
    assert auto_compile_pays(100_000, cached=False)


def test_warm_up_plans_are_decode_steps_in_block_zero():
    for block_size in (16, 4):
        plans = warm_up_plans(block_size)
        assert {one: p.num_tokens for one, p in plans.items()} == {True: 1, False: WARM_UP_ROWS}
        for plan in plans.values():
            batch = ForwardBatch(plan, block_size, "cpu")
            assert CompiledDecodeStep.handles(batch)
            assert (plan.slot_mapping < block_size).all() and (plan.block_tables == 0).all()


def test_without_the_cache_decode_graphs_are_compiled_and_never_saved(tiny_model, monkeypatch,
                                                                     tmp_path):
    """`--no-cache` (no cache key): both graphs compiled, nothing read or written; with a key
    the same step would have been saved under the cache root."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    traced = []
    monkeypatch.setattr(compiled_step, "_aot_compile",
                        lambda function, example, cpp_wrapper: traced.append(example) or function)
    step = CompiledDecodeStep(tiny_model, None)
    batches = {one: ForwardBatch(plan, 16, "cpu") for one, plan in warm_up_plans(16).items()}
    assert not step.cached()
    assert step.prepare(batches) == (0, 2)
    assert step.ready and len(traced) == 2
    assert not any(tmp_path.rglob("*.bin"))
    assert CompiledDecodeStep(tiny_model, "key")._path(True).is_relative_to(tmp_path)


def test_decode_block_tables_are_never_narrower_than_the_traced_width():
    """A 3-token sequence's decode step is padded to DECODE_MIN_BLOCKS blocks (masked), so the
    compiled graph's symbolic width serves it instead of compiling a graph for width 1."""
    from braid.layers.forward_batch import DECODE_MIN_BLOCKS

    plan = warm_up_plans(16)[False]
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
    plan = warm_up_plans(16)[False]
    plan.kv_lens[:] = 20  # two blocks of 16
    plan.block_tables = np.arange(WARM_UP_ROWS * 5).reshape(WARM_UP_ROWS, 5)
    tables = ForwardBatch(plan, 16, "cpu").attn_groups[0].meta.block_tables
    assert tables.is_contiguous()
    assert tables.tolist() == plan.block_tables[:, :2].tolist()


def test_the_kernel_plan_reads_decode_through_the_operator_where_it_fits(tiny_model,
                                                                         model_path):
    """One plan per rank decides: SmolLM2's heads take the C++ decode operator, whose layout
    (tokens innermost, or in pairs) compiled steps share; the layers follow it as their caches
    are made. A block size the operator does not take leaves decode on SDPA and, with steps not
    compiled, the cache token-major; so does a GPU."""
    def plan(**settings):
        return plan_kernels(EngineConfig.create(model=model_path, dtype="bf16", **settings),
                            tiny_model)

    layers = tiny_model.attention_layers()
    assert not any(attn.decode_operator for attn in layers)  # the fixture's plain caches
    fitting = plan()
    assert fitting.decode_attention == "operator" and fitting.not_compiled is None
    assert fitting.kv_layout in (kv_layout.TOKENS_INNERMOST, kv_layout.PAIRS)
    try:
        for attn in layers:
            attn.allocate_cache(4, 16, torch.bfloat16, torch.device("cpu"), fitting)
        assert all(attn.decode_operator for attn in layers)
        assert all(decode_kernel.attention_fits(attn.padded_heads, attn.k_cache, torch.bfloat16)
                   for attn in layers)
    finally:
        for attn in layers:
            attn.allocate_cache(4, 16, torch.bfloat16, torch.device("cpu"))
    odd = plan(block_size=8, compile="off")
    assert odd.decode_attention == "gathered" and odd.kv_layout == kv_layout.TOKEN_MAJOR
    assert odd.not_compiled == "--compile off"
    gpu = plan(device="cuda")  # eager, SDPA, no elementwise compiling unless asked
    assert gpu.decode_attention == "gathered" and gpu.kv_layout == kv_layout.TOKEN_MAJOR
    assert "CPU" in gpu.not_compiled and gpu.fused_elementwise == "off"
    assert not (gpu.operators or gpu.packed_weights or gpu.few_rows)


needs_avx512_bf16 = pytest.mark.skipif("avx512_bf16" not in cpu_flags(),
                                       reason="the few-row kernel needs AVX512-BF16")


@needs_avx512_bf16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, columns", [(3072, 576), (45, 64), (7, 1536), (13, 96)])
def test_the_few_row_kernel_matches_the_reference(rows, columns, dtype):
    """1 to 16 input rows (one group of up to 4, several, a partial last one) against a
    row-major weight, tiles of 8 or 4 weight rows and the remainder (45, 7, 13) one by one,
    against the fp64 product; a non-contiguous input too."""
    assert decode_kernel.load()
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(rows, columns, generator=gen).to(dtype)
    assert decode_kernel.few_rows_fits(weight)
    for m in (1, 2, 3, 4, 5, 8, 11, 16):
        x = torch.randn(m, 2 * columns, generator=gen).to(dtype)[:, ::2]
        out = decode_kernel.few_rows_linear(x, weight)
        assert out.dtype == dtype and out.shape == (m, rows)
        # fp32 sums, rounded once to the output's dtype at the end
        rtol = 2 ** -8 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(out.double(), x.double() @ weight.double().t(),
                                   atol=1e-3 * columns ** 0.5, rtol=rtol)


@needs_avx512_bf16
def test_the_few_row_kernels_refuse_what_they_do_not_compute():
    assert decode_kernel.load()
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        decode_kernel.few_rows_linear(torch.zeros(1, 48, dtype=torch.bfloat16),
                                      weight[:, :48].clone())
    with pytest.raises(RuntimeError, match="of the input's dtype"):
        decode_kernel.few_rows_linear(torch.zeros(2, 64), weight)
    with pytest.raises(RuntimeError, match="an input \\[M, K\\] and a weight"):
        decode_kernel.few_rows_linear(torch.zeros(2, 32, dtype=torch.bfloat16), weight)
    assert not decode_kernel.few_rows_fits(weight.half())
    assert not decode_kernel.few_rows_fits(weight.t())
    assert not decode_kernel.few_rows_fits(torch.zeros(8, 40))


@needs_avx512_bf16
@pytest.mark.parametrize("gated", [False, True])
def test_products_by_row_count_in_a_compiled_graph(gated):
    """A graph whose row count is a symbol holds one `linear_by_rows` call, which computes
    every row count like eager ATen: the few-row kernel up to the layer's limit, the packed
    weight (or its packed halves, for SwiGLU) beyond."""
    from braid.layers.linear import ReplicatedLinear
    from braid.layers.quant import pack_linear_layers, swiglu

    layer = ReplicatedLinear(64, 96, dtype=torch.bfloat16)
    layer.weight.data.copy_(torch.randn(96, 64))
    layer.gated = gated
    assert pack_linear_layers(layer, None)
    layer.few_rows = 4
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes])
        return gm.forward

    def product(x):
        return swiglu(layer, x) if gated else layer(x)

    compiled = torch.compile(product, backend=record, fullgraph=True, dynamic=True)
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        reference = F.linear(x.float(), layer.weight.float())
        if gated:
            gate, up = reference.chunk(2, dim=-1)
            reference = F.silu(gate) * up
        torch.testing.assert_close(compiled(x).float(), reference, atol=5e-2, rtol=2 ** -6)
    # One graph for a single row (dynamo specialises a size of 1), one for every other count
    assert len(graphs) == 2
    assert all(targets.count("braid.linear_by_rows") == 1 for targets in graphs)


def test_a_saved_graphs_key_names_the_settings_that_shape_its_code(model_path):
    """A graph saved under one setting is never loaded for another: its operators' arguments
    (the blocks' input rounding, the weights' forms, the dtypes) are constants of its code."""
    base = EngineConfig.create(model=model_path)

    def key(engine: EngineConfig) -> str:
        return compiled_step.graph_cache_key(engine, model_path, 0, 2, False, 64)

    for change in (dict(block_inputs="float"), dict(quantization="none"),
                   dict(kv_cache_dtype="int8"), dict(dtype="bf16" if base.dtype == "fp32"
                                                       else "fp32")):
        assert key(base.replace(**change)) != key(base), change
    assert key(base.replace(prefix_caching=False)) == key(base)  # the scheduler's: no graph's
