"""The one place a rank decides which kernels its steps run (`plan_kernels`), once, when its
model is built: from the host (ISA, whether braid's operators built), the engine's settings and
the model's shapes. The layers read the resulting `KernelPlan` when their weights and KV cache
are made; the model runner reads whether steps compile. Each choice is the one measured fastest
for its shape and host (docs/performance.md); where a kernel cannot run here, the plan names
the one that can.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from braid import native
from braid.config import EngineConfig
from braid.layers import decode_kernel, kv_layout
from braid.layers.attention import PagedAttention
from braid.layers.ggml_weight import keeps_quantized_blocks
from braid.layers.kernel_plan import KernelPlan
from braid.layers.moe import RoutedExperts
from braid.layers.quant import packing_supported
from braid.platform import cpu_flags

# bf16 GEMMs of at most this many rows read oneDNN's packed weights on CPUs with AMX; larger
# ones read the row-major weight, which AMX's GEMM reorders faster than it reads the blocked
# one. Without AMX the packed weights win at any size.
AMX_PACKED_MAX_ROWS = 256


def plan_kernels(engine: EngineConfig, model: nn.Module) -> KernelPlan:
    """The kernel plan of one rank of `model` (built, weights not needed) under `engine`."""
    device = engine.parallel.device
    dtype, kv_dtype = engine.torch_dtype, engine.kv_torch_dtype
    operators = device == "cpu" and native.load()
    not_compiled = ("--compile off" if engine.compile.mode == "off"
                    else compile_applies(device, model))
    decode_operator = operators and decode_operator_fits(engine, model)
    attention = model.attention_layers()
    layout = kv_layout.TOKEN_MAJOR
    if decode_operator or not_compiled is None:  # both read a block's tokens innermost
        # (both need every attention layer paged, so the first's head dim is theirs)
        layout = cache_layout(kv_dtype, engine.kv_cache.block_size, attention[0].head_dim)
    return KernelPlan(
        operators=operators,
        kv_layout=layout,
        decode_attention="operator" if decode_operator else "gathered",
        prefill_attention=_prefill_attention(decode_operator, attention, dtype, device),
        gguf_blocks=operators and keeps_quantized_blocks(engine, model.config),
        round_block_inputs=engine.compile.block_inputs == "int8",
        # Without AMX, the int8 kernel over interleaved groups beats a bf16 GEMM over decoded
        # tiles at every row count; with it, AMX's bf16 GEMM is the faster for many rows
        block_inputs_all_rows="amx_bf16" not in cpu_flags(),
        rounded_weights=_rounded_weights(engine, operators),
        packed_weights=(_packs(engine, operators)
                        and packing_supported(torch.empty(0, dtype=dtype, device=device))),
        packed_max_rows=AMX_PACKED_MAX_ROWS if "amx_bf16" in cpu_flags() else None,
        few_rows=_few_rows(engine) if operators else 0,
        # auto: CPU only (measured there); CUDA runs eager unless asked
        fused_elementwise=("off" if engine.compile.mode == "auto" and device != "cpu"
                           else engine.compile.mode),
        not_compiled=not_compiled)


# GEMMs of up to this many rows run the few-row kernel by default. In bf16 it ties oneDNN's
# packed GEMM from a few rows to 32 and computes each output alike whatever the row count, so
# a sequence's tokens do not hang on how many rows share its step (drafts included); in fp32
# it beats ATen's GEMM up to 16 rows and loses at 32
FEW_ROWS_DEFAULT = {torch.bfloat16: 32, torch.float32: 16}


def _few_rows(engine: EngineConfig) -> int:
    """The rows up to which GEMMs run the few-row kernel (`--few-row-gemm`)."""
    if engine.compile.few_row_gemm is not None:
        return engine.compile.few_row_gemm
    return FEW_ROWS_DEFAULT.get(engine.torch_dtype, 0)


def cache_layout(kv_dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The `kv_layout` of a KV cache whose blocks are read with their tokens innermost: in
    pairs where the decode operator reads this cache dtype two elements at a time."""
    if decode_kernel.pairs_fit(kv_dtype, block_size, head_dim):
        return kv_layout.PAIRS
    return kv_layout.TOKENS_INNERMOST


def compile_applies(device: str, model: nn.Module) -> str | None:
    """None where compiled steps can run this model here, else why not: on CPU (CUDA steps run
    eager), with every attention layer a `PagedAttention` (DeepSeek's MLA stays eager) and no
    routed experts (Qwen3-MoE, Mixtral, DeepSeek: each expert's share of the tokens is a
    data-dependent shape, which graphs do not hold)."""
    if device != "cpu":
        return "compiled steps are built for CPU ranks"
    if not all(isinstance(a, PagedAttention) for a in model.attention_layers()):
        return f"{type(model).__name__}'s attention is not compiled"
    if any(isinstance(m, RoutedExperts) for m in model.modules()):
        return f"{type(model).__name__}'s routed experts are not compiled"
    return None


def decode_operator_fits(engine: EngineConfig, model: nn.Module) -> bool:
    """Whether decode steps read the KV cache through `decode_kernel`'s operator, laid out for
    it: on CPU, where every attention layer is a `PagedAttention` whose shapes the operator
    takes (a rank's unequal query groups padded to one grouped call). It beats gathering the
    blocks for SDPA at every batch size measured, most at large batches, and an int8 cache,
    whose gathered blocks SDPA needs dequantized, gains most."""
    if engine.parallel.device != "cpu":
        return False
    return all(isinstance(attn, PagedAttention)
               and decode_kernel.shape_fits(attn.padded_heads, attn.num_kv_heads, attn.head_dim,
                                            engine.kv_cache.block_size, engine.torch_dtype,
                                            engine.kv_torch_dtype)
               for attn in model.attention_layers())


def _prefill_attention(decode_operator: bool, attention: list[nn.Module], dtype: torch.dtype,
                       device: str) -> str:
    """The prefill kernel that beats SDPA here: the C++ operator (bf16 on AVX512-BF16, with the
    decode operator's library), else the blocked GEMMs where `blocked_prefill_is_faster`."""
    first = attention[0]
    if (decode_operator and isinstance(first, PagedAttention)
            and decode_kernel.prefill_fits(first.padded_heads, first.num_kv_heads,
                                           first.head_dim, dtype)):
        return "operator"
    return "blocked" if blocked_prefill_is_faster(dtype, device) else "sdpa"


def blocked_prefill_is_faster(dtype: torch.dtype, device: str) -> bool:
    """Whether prefill runs `blocked_causal_attention` rather than SDPA: for bf16 on a CPU that
    computes bf16 natively without AMX, where it measured twice as fast or more with and without
    a cached prefix. With AMX, SDPA's kernel is the faster of the two, and
    `decode_kernel.causal_prefill_attention` faster still; in fp32 neither wins everywhere,
    so SDPA stays."""
    return (device == "cpu" and dtype == torch.bfloat16
            and "avx512_bf16" in cpu_flags() and "amx_bf16" not in cpu_flags())


def _packs(engine: EngineConfig, operators: bool) -> bool:
    """`--weight-packing`: auto packs where the copy pays for its memory, on CPUs with AMX
    (1.4x faster GEMMs of 33-256 rows) or where the few-row kernel is off (oneDNN then runs
    decode's GEMMs); without AMX the few-row kernel takes decode and packed prefill GEMMs
    tied the row-major ones (docs/kernel-choices.md, "Packed bf16 weights")."""
    mode = engine.compile.weight_packing
    if mode == "auto":
        few_rows_here = _few_rows(engine) > 0 and decode_kernel.few_rows_serve(
            engine.torch_dtype)
        return operators and ("amx_bf16" in cpu_flags() or not few_rows_here)
    return operators and mode == "on"


def _rounded_weights(engine: EngineConfig, operators: bool) -> int:
    """The bits of `--quantization int4` or `int8` (0 for the other modes), where braid's
    kernels compute from GGML blocks: its operators built, on CPUs whose vector units serve the
    run's dtype (elsewhere every GEMM would decode its whole weight)."""
    bits = {"int4": 4, "int8": 8}.get(engine.compile.quantization, 0)
    if bits and (not operators or engine.parallel.device != "cpu"
                 or not decode_kernel.block_kernels_serve(engine.torch_dtype)):
        warnings.warn(f"--quantization int{bits} runs dense: its kernels need braid's operators "
                      "on a CPU with AVX2 and FMA (fp32) or AVX512-BF16 (bf16)", stacklevel=3)
        return 0
    return bits
