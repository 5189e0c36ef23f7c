"""`braid bench-attention --read-rate`: how fast the decode attention operator reads the KV
cache, against how fast this host's cores can read memory at all.

Decode at large batch streams every cached key and value once a step, so the operator's
figure of merit is bytes a second, and the ceiling is the memory's. The probe sums a buffer
far larger than the caches (`PROBE_BYTES`, STREAM's "read" kernel as a torch reduction); the
operator attends over one cache per layer of the model (`LAYERS` caches, more than the
last-level cache holds, as in a real step), laid out as the engine lays them out on this host,
sequences' blocks allocated in order as the scheduler allocates a batch's prompts. Both run on
the same threads: the cores of one rank at `--tp`.
"""

from __future__ import annotations

import time

import torch

from braid.config import KVCacheConfig
from braid.layers import decode_kernel, kv_layout
from braid.layers.attention import row_scales
from braid.worker.kernels import cache_layout

PROBE_BYTES = 1 << 30
LAYERS = 30
BLOCK_SIZE = KVCacheConfig().block_size  # the engine's default


def probe_read_rate(repeat: int = 5) -> float:
    """GB/s of summing a 1 GiB buffer with the current threads (best of `repeat`)."""
    buffer = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)
    buffer.sum()
    best = min(_seconds(buffer.sum) for _ in range(repeat))
    return PROBE_BYTES / best / 1e9


def operator_read_rate(batch: int, context: int, heads: int, kv_heads: int, dim: int,
                       dtype: torch.dtype, cache_dtype: torch.dtype, repeat: int = 5) -> float:
    """GB/s of keys and values (and an int8 cache's scales) the decode operator reads:
    `batch` sequences of `context` cached tokens, one cache per layer, attended layer after
    layer (best of `repeat`)."""
    per_sequence = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_sequence + 1
    layout = cache_layout(cache_dtype, BLOCK_SIZE, dim)
    int8 = cache_dtype == torch.int8
    gen = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(LAYERS):
        cache = kv_layout.allocate(layout, num_blocks, BLOCK_SIZE, kv_heads, dim, cache_dtype,
                                   torch.device("cpu"))
        for part in cache:
            part.copy_(torch.randint(-127, 128, part.shape, generator=gen) if int8
                       else torch.randn(part.shape, generator=gen))
        scales = [row_scales(num_blocks, BLOCK_SIZE, kv_heads, torch.device("cpu"), True)
                  .fill_(1 / 127) for _ in cache] if int8 else [None, None]
        caches.append((*cache, *scales))
    tables = torch.arange(1, num_blocks).view(batch, per_sequence)
    lengths = torch.full((batch,), context)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)

    def step() -> None:
        for keys, values, key_scales, value_scales in caches:
            decode_kernel.paged_decode_attention(q, keys, values, tables, lengths, dim ** -0.5,
                                                 key_scales, value_scales)

    step()
    best = min(_seconds(step) for _ in range(repeat))
    row_bytes = dim * cache_dtype.itemsize + (4 if int8 else 0)
    return LAYERS * batch * context * kv_heads * 2 * row_bytes / best / 1e9


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
