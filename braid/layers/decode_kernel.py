"""The step's C++ attention and GEMV operators on CPU (built with braid's other operators by
`braid.native`):

- `torch.ops.braid.paged_decode_attention`: decode attention over the paged KV cache, of the
  model's dtype or int8 (`csrc/paged_decode_attention.cpp`), in eager and compiled decode steps;
- `torch.ops.braid.few_rows_linear` (and `linear_by_rows`, which picks it by row count): a
  linear layer's product for a few rows with its row-major bf16 (AVX512-BF16) or fp32 (AVX-512)
  weight (`csrc/gemv.cpp`), eager and in compiled graphs;
- `torch.ops.braid.causal_prefill_attention`: causal attention of fresh prompts or chunks over
  their keys, bf16 on CPUs with AVX512-BF16 (`csrc/prefill_attention.cpp`), in eager prefill.

Inductor's code for the same reductions (`traced_decode_attention`) is bound by add latency and
memory stalls; the operator takes a third of its time. At a few rows a GEMM streams its weight,
which the few-row kernel does with less overhead than oneDNN's GEMMs, packed or not
(docs/kernel-choices.md, "Attention" and "GEMMs of a few rows"). Where the library cannot be
built the steps keep the traced kernel and oneDNN's GEMMs.
"""

from __future__ import annotations

import torch

from braid import native
from braid.layers import kv_layout
from braid.platform import cpu_flags

# Block sizes and head dims must be multiples of the vector width (16 floats at most).
_VECTOR_FLOATS = 16
_MAX_GROUP = 8  # query heads per KV head the kernel is instantiated for
# elements of a weight row the few-row kernel reads per instruction: its K must be a multiple
_FEW_ROWS_CHUNK = {torch.bfloat16: 32, torch.float32: 16}


def load() -> bool:
    """Whether the operators are built (building or loading them on first use)."""
    return native.load()


def attention_fits(heads: int, k_cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the operator handles `heads` query heads of `dtype` over this key cache
    (`shape_fits`, in the tokens-innermost or pair layout)."""
    _, block_size, kv_heads, head_dim = kv_layout.logical_shape(k_cache)
    return (k_cache.device.type == "cpu"
            and (kv_layout.is_paired(k_cache) or k_cache.stride(1) == 1)
            and shape_fits(heads, kv_heads, head_dim, block_size, dtype, k_cache.dtype))


def pairs_fit(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether a cache of `dtype` that the operator reads is stored in `kv_layout.PAIRS`
    (head dims up to 512, the library built for AVX-512):

    - int8 on a CPU with AVX512-VNNI: scores and weighted values as int16 dot products, the
      queries and softmax weights rounded to int16 (2^-16 of a row's largest, a hundredth of
      the cache's own rounding), faster than widening each int8 to fp32 for an FMA
      (docs/kernel-choices.md, "The KV cache in pairs").
    - bf16 on a CPU with AVX512-BF16: `vdpbf16ps` over pairs, the softmax weights rounded to
      bf16 (as transformers' bf16 attention rounds them).
    """
    flag = {torch.int8: "avx512_vnni", torch.bfloat16: "avx512_bf16"}.get(dtype)
    return (flag is not None and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and flag in cpu_flags()
            and block_size % _VECTOR_FLOATS == 0 and head_dim % _VECTOR_FLOATS == 0
            and head_dim <= 512)


def shape_fits(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
               cache_dtype: torch.dtype) -> bool:
    """Whether the operator computes this attention on CPU: bf16 or fp32 queries over a cache
    of their dtype or int8, block size and head dim multiples of the vector width, at most
    `_MAX_GROUP` query heads per KV head."""
    return (dtype in (torch.bfloat16, torch.float32) and cache_dtype in (dtype, torch.int8)
            and block_size % _VECTOR_FLOATS == 0 and head_dim % _VECTOR_FLOATS == 0
            and heads % kv_heads == 0 and heads // kv_heads <= _MAX_GROUP)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None,
                           kv_parts: torch.Tensor | None = None,
                           row_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [blocks, block_size, Hk, D] in `kv_layout`'s tokens-innermost
    layout or (int8 or bf16) its pair layout, of q's dtype, or int8 with their [blocks,
    block_size, Hk] float32 scales (laid out as the keys' tokens); block_tables: [B, W] int64;
    seq_lens: [B] int64 keys per sequence -> [B, Hq, D].

    `kv_parts` ([Hk, 2] int64, `HeadShard.kv_parts`): per KV head, this rank's part of the
    rows and their number of parts, with `row_tokens` ([B] int64), each row's input token; a
    KV head split in parts is attended only over the rows whose part, a hash of the row's
    length and token, is this rank's; its other rows' outputs are zeros (see `RowShares` in
    the C++ source)."""
    return torch.ops.braid.paged_decode_attention(q, k_cache, v_cache, k_scales, v_scales,
                                                  block_tables, seq_lens, scale, kv_parts,
                                                  row_tokens)


def few_rows_serve(dtype: torch.dtype) -> bool:
    """Whether this CPU runs the few-row kernel (and the GGUF blocks' decode kernels) for
    activations of `dtype`: bf16 with AVX512-BF16, fp32 with AVX-512 (the library is built for
    the host's ISA)."""
    flag = {torch.bfloat16: "avx512_bf16", torch.float32: "avx512f"}.get(dtype)
    return flag in cpu_flags()


def block_kernels_serve(dtype: torch.dtype) -> bool:
    """Whether this CPU's kernels over GGML blocks (`braid.layers.ggml_weight`) multiply
    activations of `dtype` as they decode (elsewhere every GEMM would decode its whole weight
    first): where the few-row kernel serves, and fp32 with AVX2 and FMA
    (`csrc/ggml_avx2.cpp`)."""
    avx2 = dtype == torch.float32 and {"avx2", "fma", "f16c"} <= cpu_flags()
    return avx2 or few_rows_serve(dtype)


def few_rows_fits(weight: torch.Tensor) -> bool:
    """Whether the few-row kernel takes this weight: row-major, on a CPU it serves
    (`few_rows_serve`), its rows a multiple of a vector's elements."""
    return (weight.device.type == "cpu" and few_rows_serve(weight.dtype)
            and weight.dim() == 2 and weight.is_contiguous()
            and weight.shape[1] % _FEW_ROWS_CHUNK[weight.dtype] == 0)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] row-major of x's dtype (`few_rows_fits`) -> x @ weight.T."""
    return torch.ops.braid.few_rows_linear(x, weight)


def prefill_fits(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether `causal_prefill_attention` computes this prefill attention: bf16 on a CPU with
    AVX512-BF16 (its GEMMs are oneDNN's brgemm kernels: AMX's where the CPU has it,
    `vdpbf16ps` elsewhere; faster than SDPA with AMX and than `blocked_causal_attention`
    without), head dims a multiple of 32, whole groups of query heads per KV head (where the
    library builds: `load`)."""
    return (dtype == torch.bfloat16 and "avx512_bf16" in cpu_flags()
            and head_dim % 32 == 0 and heads % kv_heads == 0)


def causal_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """q: [B, T, Hq, D]; k, v: [B, L, Hk, D] with L >= T (the last T keys are the queries'
    own; query t sees keys up to L - T + t), bf16, head dims contiguous -> [B, T, Hq, D].

    Faster than SDPA with AMX and than `blocked_causal_attention` without, fresh prompts and
    chunks after a cached prefix alike (docs/kernel-choices.md, "Prefill attention")."""
    return torch.ops.braid.causal_prefill_attention(q, k, v, scale)

