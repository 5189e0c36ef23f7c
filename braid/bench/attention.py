"""`braid bench-attention`: the attention paths at the shapes the engine runs, side by side.

Paths:
- `engine`: what braid runs for the shape on this host and dtype (`braid.layers.attention_ops`);
- `sdpa-padded`: braid's previous path, every sequence's queries padded to the group's longest
  against all gathered keys under a dense `[B, 1, max_q, keys]` mask (`enable_gqa`);
- `sdpa` (prefill): PyTorch's fused SDPA per sequence (one batched call for fresh prompts of
  equal length);
- `grouped-matmul` (decode) and `blocked-matmul` (prefill, `blocked_causal_attention`): GEMMs
  in the model's dtype and a softmax accumulated in fp32, queries grouped by KV head, prefill
  query blocks attending only up to their diagonal;
- `brgemm-operator` (prefill, bf16 on a CPU with AVX512-BF16; named `amx-brgemm` before it
  ran without AMX): `decode_kernel.causal_prefill_attention`, oneDNN's brgemm over keys
  packed once per KV head, blocks past the diagonal skipped.
Inputs are random, shaped as rank 0's heads of the model at `--tp`; each time is the median of
`--repeat` calls after warm-up, in this process, on every usable core.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from braid.config import DTYPES, default_model_path, resolve_dtype
from braid.layers import decode_kernel
from braid.layers.attention_ops import (
    batched_causal_attention,
    blocked_causal_attention,
    causal_attention,
    decode_attention,
    prefix_causal_mask,
)
from braid.layers.partition import partition_heads
from braid.loader.model_config import load_model_config
from braid.platform import usable_cores
from braid.worker.kernels import blocked_prefill_is_faster

DECODE_SHAPES = [(1, 128), (1, 512), (8, 512), (32, 128), (32, 512), (64, 1024)]
PREFILL_SHAPES = [(1, 128, 0), (1, 512, 0), (8, 512, 0), (1, 2048, 0), (1, 512, 1536),
                  (4, 256, 256)]


def grouped_matmul_decode(q, keys, values, key_mask, scale):
    """q: [B, Hq, D]; keys, values: [B, L, Hk, D]; key_mask: [B, 1, 1, L] -> [B, Hq, D]."""
    batch, _, hk, dim = keys.shape
    queries = q.view(batch, hk, -1, dim)  # [B, Hk, g, D]
    scores = torch.matmul(queries, keys.permute(0, 2, 3, 1)).float() * scale  # [B, Hk, g, L]
    scores.masked_fill_(~key_mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(values.dtype), values.transpose(1, 2))
    return out.reshape(batch, q.shape[1], -1)


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def decode_paths(batch: int, context: int, hq: int, hk: int, dim: int, dtype: torch.dtype):
    """{path: callable}: one new token per sequence against up to `context` cached keys."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(context // 2, context + 1, (batch,), generator=gen)
    lengths[0] = context
    q = torch.randn(batch, hq, dim, generator=gen).to(dtype)
    keys = torch.randn(batch, context, hk, dim, generator=gen).to(dtype)  # as gathered
    values = torch.randn(batch, context, hk, dim, generator=gen).to(dtype)
    key_mask = (torch.arange(context)[None, :] < lengths[:, None])[:, None, None]
    scale = dim ** -0.5
    return {
        "sdpa-padded": lambda: F.scaled_dot_product_attention(
            q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=key_mask, enable_gqa=hq != hk),
        "engine": lambda: decode_attention(q, keys, values, key_mask, scale),
        "grouped-matmul": lambda: grouped_matmul_decode(q, keys, values, key_mask, scale),
    }


def prefill_paths(batch: int, tokens: int, prefix: int, hq: int, hk: int, dim: int,
                  dtype: torch.dtype):
    """{path: callable}: `batch` sequences of `tokens` new tokens after `prefix` cached ones."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, tokens, hq, dim, generator=gen).to(dtype)
    keys = torch.randn(batch, prefix + tokens, hk, dim, generator=gen).to(dtype)
    values = torch.randn(batch, prefix + tokens, hk, dim, generator=gen).to(dtype)
    scale = dim ** -0.5
    if prefix == 0:
        padded = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True,
            enable_gqa=hq != hk)
        sdpa = lambda: batched_causal_attention(q, keys, values, scale)  # noqa: E731
    else:
        mask = prefix_causal_mask(tokens, prefix, q.device)
        padded = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[None, None], enable_gqa=hq != hk)
        sdpa = lambda: [causal_attention(q[b], keys[b], values[b], mask, scale)  # noqa: E731
                        for b in range(batch)]
    blocked = lambda: blocked_causal_attention(q, keys, values, scale)  # noqa: E731
    paths = {"sdpa-padded": padded, "engine": sdpa, "sdpa": sdpa, "blocked-matmul": blocked}
    if blocked_prefill_is_faster(dtype, q.device.type):
        paths["engine"] = blocked
    if decode_kernel.prefill_fits(hq, hk, dim, dtype) and decode_kernel.load():
        paths["engine"] = paths["brgemm-operator"] = lambda: decode_kernel.causal_prefill_attention(
            q, keys, values, scale)
    return paths


def run_bench_attention(args: argparse.Namespace) -> None:
    torch.set_num_threads(len(usable_cores()))
    config = load_model_config(args.model or default_model_path())
    dtype = DTYPES[resolve_dtype(args.dtype)]
    shard = partition_heads(config.num_heads, config.num_kv_heads, args.tp)[0]
    if args.read_rate:
        cache_dtype = torch.int8 if args.kv_cache_dtype == "int8" else dtype
        return _print_read_rates(shard.kv_count * shard.group_size, shard.kv_count,
                                 config.head_dim, dtype, cache_dtype, args.tp)
    # A rank holding part of a KV group attends per uniformly grouped run; time the largest.
    _, heads, _, kv_heads = max(shard.runs(), key=lambda run: run[1])
    dim = config.head_dim
    print(f"attention of rank 0 at tp {args.tp}: {heads} query heads, {kv_heads} KV heads"
          f"{' (its largest uniform run)' if len(shard.runs()) > 1 else ''}, head dim {dim}, "
          f"{dtype}, {torch.get_num_threads()} threads")
    cases = [(f"decode bs {b}, context {c}", decode_paths(b, c, heads, kv_heads, dim, dtype))
             for b, c in DECODE_SHAPES]
    cases += [(f"prefill {b} x {t}" + (f" after {p}" if p else ""),
               prefill_paths(b, t, p, heads, kv_heads, dim, dtype)) for b, t, p in PREFILL_SHAPES]
    print(f"{'shape':<30} {'path':<15} {'ms':>9} {'vs sdpa-padded':>15}")
    with torch.inference_mode():
        for shape, paths in cases:
            times = {name: _median_ms(fn, args.repeat) for name, fn in paths.items()}
            for name, ms in times.items():
                ratio = times["sdpa-padded"] / ms
                print(f"{shape:<30} {name:<15} {ms:9.3f} {ratio:14.2f}x", flush=True)
                if args.result_file:
                    with open(args.result_file, "a") as f:
                        f.write(json.dumps({"shape": shape, "path": name, "ms": ms,
                                            "speedup_vs_sdpa_padded": ratio,
                                            "dtype": str(dtype).removeprefix("torch."),
                                            "tp": args.tp}) + "\n")


READ_RATE_SHAPES = [(32, 256), (32, 1024), (8, 4096)]


def _print_read_rates(heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                      cache_dtype: torch.dtype, tp: int) -> None:
    """The decode operator's read rate at `READ_RATE_SHAPES` against the probe's, on the cores
    of one rank at `tp` (`braid.bench.read_rate`)."""
    from braid.bench.read_rate import operator_read_rate, probe_read_rate

    if not decode_kernel.load():
        raise SystemExit("braid's C++ operators could not be built: no decode operator to time")
    torch.set_num_threads(max(1, len(usable_cores()) // tp))
    probe = probe_read_rate()
    print(f"rank 0 at tp {tp}: {kv_heads} KV heads of dim {dim} ({heads} query heads), {dtype} "
          f"queries, {cache_dtype} cache, {torch.get_num_threads()} threads; memory read probe "
          f"{probe:.1f} GB/s")
    with torch.inference_mode():
        for batch, context in READ_RATE_SHAPES:
            rate = operator_read_rate(batch, context, heads, kv_heads, dim, dtype, cache_dtype)
            print(f"decode bs {batch}, context {context}: operator reads {rate:.1f} GB/s, "
                  f"{rate / probe:.0%} of the probe", flush=True)
