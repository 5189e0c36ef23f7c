"""The attention kernels (and the benchmark's candidates) against a plain reference: per head,
keys repeated for grouped-query attention, a dense causal mask offset by the cached prefix,
softmax in fp64."""

from __future__ import annotations

import pytest
import torch

from braid.bench.attention import grouped_matmul_decode
from braid.layers.attention_ops import (
    batched_causal_attention,
    blocked_causal_attention,
    causal_attention,
    decode_attention,
    prefix_causal_mask,
    traced_decode_attention,
)
from braid.layers.kernel_plan import KernelPlan
from braid.worker.kernels import cache_layout

HEADS = [(9, 3), (4, 4), (6, 1)]  # (query heads, KV heads)


def _int8_pairs_fit() -> bool:
    from braid.layers import decode_kernel

    return decode_kernel.pairs_fit(torch.int8, 16, 64)


def reference(q, keys, values, prefix, scale):
    """q: [T, Hq, D]; keys, values: [prefix + T, Hk, D]; query t sees keys [0, prefix + t]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().transpose(0, 1).repeat_interleave(group, 0)
    v = values.double().transpose(0, 1).repeat_interleave(group, 0)
    scores = torch.einsum("thd,hkd->htk", q.double(), k) * scale
    t = torch.arange(q.shape[0])[:, None]
    scores.masked_fill_(torch.arange(k.shape[1])[None, :] > prefix + t, float("-inf"))
    return torch.einsum("htk,hkd->thd", scores.softmax(-1), v)


def close(actual, expected):
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-4)


def inputs(hq, hk, tokens, prefix, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hq, 16, generator=gen),
            torch.randn(prefix + tokens, hk, 16, generator=gen),
            torch.randn(prefix + tokens, hk, 16, generator=gen))


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("prefix", [0, 21])
def test_causal_attention_matches_the_reference(heads, prefix):
    q, keys, values = inputs(*heads, 45, prefix, seed=prefix)
    mask = prefix_causal_mask(45, prefix, q.device) if prefix else None
    expected = reference(q, keys, values, prefix, 0.3)
    close(causal_attention(q, keys, values, mask, 0.3), expected)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("tokens", "prefix", "block"), [(45, 0, 16), (45, 21, 16), (7, 30, 64),
                                                         (64, 0, 64), (1, 5, 64)])
def test_blocked_causal_attention_matches_the_reference(heads, tokens, prefix, block):
    """Blocks that do and do not divide the tokens, with and without a prefix, a batch of
    two sequences with the same prefix length."""
    prompts = [inputs(*heads, tokens, prefix, seed=s) for s in range(2)]
    q, keys, values = (torch.stack([p[i] for p in prompts]) for i in range(3))
    out = blocked_causal_attention(q, keys, values, 0.3, block=block)
    for b, (pq, pk, pv) in enumerate(prompts):
        close(out[b], reference(pq, pk, pv, prefix, 0.3))


@pytest.mark.parametrize("heads", HEADS)
def test_batched_causal_attention_matches_the_reference(heads):
    prompts = [inputs(*heads, 20, 0, seed=s) for s in range(3)]
    q, k, v = (torch.stack([p[i] for p in prompts]) for i in range(3))
    out = batched_causal_attention(q, k, v, 0.3)
    for b, (pq, pk, pv) in enumerate(prompts):
        close(out[b], reference(pq, pk, pv, 0, 0.3))


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("decode", [decode_attention, grouped_matmul_decode])
def test_decode_attention_matches_the_reference(heads, decode):
    hq, hk = heads
    gen = torch.Generator().manual_seed(hq)
    lengths, width = [40, 1, 17, 33], 48
    q = torch.randn(len(lengths), hq, 16, generator=gen)
    keys = torch.randn(len(lengths), width, hk, 16, generator=gen)
    values = torch.randn(len(lengths), width, hk, 16, generator=gen)
    key_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])[:, None, None]
    out = decode(q, keys, values, key_mask, 0.3)
    for b, length in enumerate(lengths):
        close(out[b:b + 1], reference(q[b:b + 1], keys[b, :length], values[b, :length],
                                      length - 1, 0.3))


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(9, 3, 2), (32, 8, 3)])
def test_decode_of_unequal_groups_in_one_padded_call_equals_a_call_per_run(heads, kv_heads, tp):
    """A rank whose KV heads serve unequal query groups (an uneven split) decodes in one
    call; each real head's output equals the call per uniformly grouped run."""
    from braid.layers.attention import PagedAttention, padded_decode
    from braid.layers.partition import partition_heads

    gen = torch.Generator().manual_seed(tp)
    for shard in partition_heads(heads, kv_heads, tp):
        attn = PagedAttention(shard.q_count, shard.kv_count, 16, shard.runs())
        if len(shard.runs()) == 1:
            assert attn.decode_padded is None
            continue
        q = torch.randn(4, shard.q_count, 16, generator=gen)
        keys = torch.randn(4, 40, shard.kv_count, 16, generator=gen)
        values = torch.randn(4, 40, shard.kv_count, 16, generator=gen)
        key_mask = (torch.arange(40) < torch.tensor([40, 33, 17, 1])[:, None])[:, None, None]
        per_run = attn._by_runs(decode_attention, q, keys, values, key_mask, attn.scale)
        padded = padded_decode(decode_attention, q, keys, values, key_mask, attn.scale,
                               padded=attn.decode_padded, kept=attn.decode_kept)
        torch.testing.assert_close(padded, per_run)


def paged_attention(hq, hk, dim, tokens_innermost, num_blocks=12, block_size=4,
                    dtype=torch.float32):
    """A `PagedAttention` with a zeroed cache in the given layout."""
    from braid.layers.attention import PagedAttention

    attn = PagedAttention(hq, hk, dim)
    attn.allocate_cache(num_blocks, block_size, dtype, torch.device("cpu"),
                        layout_plan(dtype, block_size, dim, tokens_innermost))
    return attn


def layout_plan(dtype: torch.dtype, block_size: int, head_dim: int,
                tokens_innermost: bool) -> KernelPlan:
    """A kernel plan with the cache layout a rank's plan gives these shapes."""
    if not tokens_innermost:
        return KernelPlan()
    return KernelPlan(kv_layout=cache_layout(dtype, block_size, head_dim))


def test_both_cache_layouts_store_and_gather_the_same_tokens():
    """The compiled step's layout (a block's tokens innermost) holds what the token-major one
    holds, as the writes and gathers of prompt steps see it."""
    from braid.layers.attention import gather_blocks, write_cache

    gen = torch.Generator().manual_seed(0)
    new = torch.randn(10, 3, 8, generator=gen)
    slots = torch.tensor([0, 1, 2, 3, 17, 18, 44, 45, 46, 47])
    block_tables = torch.tensor([[0, 4], [11, 0]])
    gathered = []
    for tokens_innermost in (False, True):
        attn = paged_attention(9, 3, 8, tokens_innermost)
        assert attn.k_cache.shape == attn.v_cache.shape == (12, 4, 3, 8)
        assert attn.k_cache.is_contiguous() is not tokens_innermost
        for cache in (attn.k_cache, attn.v_cache):
            write_cache(cache, new, slots)
            assert torch.equal(cache.reshape(-1, 3, 8)[slots], new)
            gathered.append(gather_blocks(cache, block_tables))
    assert gathered[0].shape == (2, 8, 3, 8)
    assert torch.equal(gathered[0][0, :4], new[:4]) and torch.equal(gathered[0][0, 5:7], new[4:6])
    assert torch.equal(gathered[0][1, :4], new[6:])
    for other in gathered[1:]:
        assert torch.equal(other, gathered[0])


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_every_kv_layout_stores_and_gathers_the_same_rows(dtype):
    """`kv_layout`'s three layouts (the pair layout on any CPU: only reading it through the
    operator needs VNNI or AVX512-BF16) hold the same rows at the same slots, as writes and
    gathers see them, and report the same logical shape."""
    from braid.layers import kv_layout

    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(-127, 128, (10, 3, 8), generator=gen).to(dtype)
    slots = torch.tensor([0, 1, 2, 3, 17, 18, 44, 45, 46, 47])
    block_tables = torch.tensor([[0, 4], [11, 0]])
    gathered = []
    for layout in (kv_layout.TOKEN_MAJOR, kv_layout.TOKENS_INNERMOST, kv_layout.PAIRS):
        for cache in kv_layout.allocate(layout, 12, 4, 3, 8, dtype, torch.device("cpu")):
            assert kv_layout.logical_shape(cache) == (12, 4, 3, 8)
            assert kv_layout.is_paired(cache) == (layout == kv_layout.PAIRS)
            kv_layout.store(cache, rows, slots)
            gathered.append(kv_layout.blocks(cache, block_tables))
    assert gathered[0].shape == (2, 2, 4, 3, 8)
    assert torch.equal(gathered[0][0, 0], rows[:4]) and torch.equal(gathered[0][1, 0], rows[6:])
    for other in gathered[1:]:
        assert torch.equal(other, gathered[0])


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_the_decode_layouts_keep_a_heads_blocks_end_to_end(dtype):
    """In the layouts the decode operator reads, block b + 1 of a KV head starts where block b
    of that head ends, so a sequence's blocks allocated in order are one stream per head (the
    operator read 2 KB pieces at a stride at half the rate)."""
    from braid.layers import kv_layout

    for layout in (kv_layout.TOKENS_INNERMOST, kv_layout.PAIRS):
        for cache in kv_layout.allocate(layout, 12, 4, 3, 8, dtype, torch.device("cpu")):
            block_elements = 4 * 8
            assert cache.stride(0) == block_elements
            assert cache.untyped_storage().nbytes() == 12 * 3 * block_elements * dtype.itemsize


def test_the_read_rate_bench_times_the_operator_against_the_probe(capsys):
    """`braid bench-attention --read-rate` prints the probe's rate and the operator's at its
    shapes (tiny ones here), as fractions of the probe."""
    from braid.bench import attention, read_rate
    from braid.layers import decode_kernel

    if not decode_kernel.load():
        pytest.skip("braid's C++ operators are not built on this host")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(read_rate, "PROBE_BYTES", 1 << 24)
        patch.setattr(read_rate, "LAYERS", 2)
        patch.setattr(attention, "READ_RATE_SHAPES", [(2, 48)])
        for cache_dtype in (torch.float32, torch.int8):
            attention._print_read_rates(4, 2, 64, torch.float32, cache_dtype, tp=1)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all("GB/s" in line for line in lines)
    assert "decode bs 2, context 48: operator reads" in lines[1] and "% of the probe" in lines[1]

@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_a_compiled_step_stores_pairs_where_the_eager_one_does(dtype):
    """The compiled decode step writes the pair layout as eager code does (eager writes paired
    keys through a view of twice the element width, which inductor mishandled)."""
    from braid.layers import kv_layout

    rows = (torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(0)) * 30).to(dtype)
    slots = torch.tensor([0, 3, 17, 44, 47])
    compiled_store = torch.compile(kv_layout.store, fullgraph=True, dynamic=False)
    eager, compiled = (kv_layout.allocate(kv_layout.PAIRS, 12, 4, 3, 8, dtype, torch.device("cpu"))
                       for _ in range(2))
    for write, caches in ((kv_layout.store, eager), (compiled_store, compiled)):
        for cache in caches:
            write(cache, rows, slots)
    for ours, theirs in zip(compiled, eager):
        assert torch.equal(ours, theirs) and ours.abs().sum() > 0


@pytest.mark.parametrize("tokens_innermost", [False, True])
def test_an_int8_cache_stores_each_row_within_half_its_scale(tokens_innermost):
    """`--kv-cache-dtype int8`: a row is stored as int8 values, its largest magnitude as 127,
    and one float32 scale; read back, every element is within half a scale of what was
    written (an all-zero row stays zero), in either layout."""
    from braid.layers.attention import gather_blocks, write_cache

    gen = torch.Generator().manual_seed(0)
    new = torch.randn(10, 3, 8, generator=gen) * torch.rand(10, 3, 1, generator=gen) * 10
    new[2, 1] = 0
    slots = torch.tensor([0, 1, 2, 3, 17, 18, 44, 45, 46, 47])
    attn = paged_attention(9, 3, 8, tokens_innermost, dtype=torch.int8)
    assert attn.k_cache.dtype == torch.int8 and attn.k_cache.shape == (12, 4, 3, 8)
    assert attn.k_scales.dtype == torch.float32 and attn.k_scales.shape == (12, 4, 3)
    write_cache(attn.k_cache, new, slots, attn.k_scales)
    scales = attn.k_scales.reshape(-1, 3)[slots]
    torch.testing.assert_close(scales, new.abs().amax(-1) / 127)
    assert attn.k_cache.reshape(-1, 3, 8)[slots].abs().amax(-1).eq(
        torch.where(scales > 0, 127, 0)).all()
    stored = gather_blocks(attn.k_cache, torch.arange(12)[None], attn.k_scales, torch.float32)
    error = (stored.reshape(-1, 3, 8)[slots] - new).abs()
    assert (error <= scales[..., None] * 0.5 + 1e-6).all()
    assert stored.reshape(-1, 3, 8)[slots][2, 1].eq(0).all()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("tokens_innermost", [False, True])
@pytest.mark.parametrize("heads", HEADS)
def test_traced_decode_attention_reads_the_blocks_the_table_names(heads, tokens_innermost,
                                                                  cache_dtype):
    """The compiled step's decode kernel, run eagerly, in either cache layout, int8 or not:
    keys indexed through the block table give what the gathered blocks give."""
    from braid.layers.attention import gather_blocks

    hq, hk = heads
    gen = torch.Generator().manual_seed(hk)
    attn = paged_attention(hq, hk, 16, tokens_innermost, dtype=cache_dtype)
    fill_cache(attn, gen)
    block_tables = torch.tensor([[7, 2, 9], [0, 11, 0], [5, 0, 0]])
    lengths = [12, 5, 1]
    key_mask = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None])[:, None, None]
    q = torch.randn(3, hq, 16, generator=gen)
    out = traced_decode_attention(q, attn.k_cache, attn.v_cache, block_tables, key_mask, 0.3,
                                  attn.k_scales, attn.v_scales)
    keys = gather_blocks(attn.k_cache, block_tables, attn.k_scales, torch.float32)
    values = gather_blocks(attn.v_cache, block_tables, attn.v_scales, torch.float32)
    expected = decode_attention(q, keys, values, key_mask, 0.3)
    close(out, expected.double())


def fill_cache(attn, gen: torch.Generator) -> None:
    """Random rows of varied magnitude in every slot, through `write_cache` (quantized into an
    int8 cache)."""
    from braid.layers import kv_layout
    from braid.layers.attention import write_cache

    blocks, block_size, heads, dim = kv_layout.logical_shape(attn.k_cache)
    slots = torch.arange(blocks * block_size)
    for cache, scales in ((attn.k_cache, attn.k_scales), (attn.v_cache, attn.v_scales)):
        rows = torch.randn(len(slots), heads, dim, generator=gen)
        rows *= torch.rand(len(slots), heads, 1, generator=gen) * 2
        write_cache(cache, rows if scales is not None else rows.to(cache.dtype), slots, scales)


@pytest.mark.parametrize("int8_cache", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_decode_kernel_matches_the_reference(heads, head_dim, dtype, int8_cache):
    """The compiled step's C++ decode operator against the fp64 reference, through a shuffled
    block table, at lengths that end mid-block, on a block boundary and within the first
    block; head_dim 48 takes the path that accumulates one vector of it at a time. The
    queries are a view of queries and keys, as the compiled step passes them. An int8 cache
    is compared with the reference on the values it stores (its rows times their scales)."""
    from braid.layers import decode_kernel, kv_layout
    from braid.layers.attention import gather_blocks

    assert decode_kernel.load()
    hq, hk = heads
    block_size, width = 16, 5
    gen = torch.Generator().manual_seed(hq)
    attn = paged_attention(hq, hk, head_dim, tokens_innermost=True, num_blocks=24,
                           block_size=block_size, dtype=torch.int8 if int8_cache else dtype)
    fill_cache(attn, gen)
    block_tables = torch.randperm(24, generator=gen)[:4 * width].view(4, width)
    lengths = [77, 32, 1, 50]
    q = torch.randn(4, hq + hk, head_dim, generator=gen).to(dtype)[:, :hq]
    assert decode_kernel.attention_fits(hq, attn.k_cache, dtype)
    out = decode_kernel.paged_decode_attention(q, attn.k_cache, attn.v_cache, block_tables,
                                               torch.tensor(lengths), head_dim ** -0.5,
                                               attn.k_scales, attn.v_scales)
    assert out.dtype == dtype and out.shape == q.shape
    assert kv_layout.is_paired(attn.k_cache) == decode_kernel.pairs_fit(
        attn.k_cache.dtype, block_size, head_dim)
    # bf16: the output's rounding (2^-8 relative) on values of order 1
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2,
                                                                            "rtol": 1e-2}
    if kv_layout.is_paired(attn.k_cache) and dtype == torch.float32:
        tolerance = PAIRED_TOLERANCE
    for b, n in enumerate(lengths):
        table = block_tables[b:b + 1]
        keys = gather_blocks(attn.k_cache, table, attn.k_scales, torch.float64)[0, :n]
        values = gather_blocks(attn.v_cache, table, attn.v_scales, torch.float64)[0, :n]
        expected = reference(q[b:b + 1], keys, values, n - 1, head_dim ** -0.5)
        torch.testing.assert_close(out[b:b + 1].double(), expected, **tolerance)


def per_head_reference(q, keys, values, prefix, scale, shard):
    """`reference` for a rank's heads `shard` (a `HeadShard`): each query head against the KV
    head of its group, wherever the split cut the groups."""
    kv_of = [(shard.q_start + h) // shard.group_size - shard.kv_start
             for h in range(shard.q_count)]
    return torch.cat([reference(q[:, h:h + 1], keys[:, kv:kv + 1], values[:, kv:kv + 1],
                                prefix, scale) for h, kv in enumerate(kv_of)], dim=1)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(9, 3, 2), (32, 8, 3)])
def test_the_decode_kernel_serves_a_rank_of_unequal_groups(heads, kv_heads, tp):
    """A rank whose KV heads serve unequal query groups (SmolLM2's 9 heads at tp 2: 3 and 2)
    decodes through the operator in one padded call; every head matches the reference."""
    from types import SimpleNamespace

    from braid.layers import decode_kernel
    from braid.layers.attention import PagedAttention, gather_blocks
    from braid.layers.partition import partition_heads

    assert decode_kernel.load()
    gen = torch.Generator().manual_seed(tp)
    for shard in partition_heads(heads, kv_heads, tp):
        attn = PagedAttention(shard.q_count, shard.kv_count, 64, shard.runs())
        attn.allocate_cache(16, 16, torch.float32, torch.device("cpu"),
                            KernelPlan(kv_layout=cache_layout(torch.float32, 16, 64)))
        fill_cache(attn, gen)
        assert decode_kernel.attention_fits(attn.padded_heads, attn.k_cache, torch.float32)
        lengths = [40, 17, 1]
        meta = SimpleNamespace(block_tables=torch.randperm(16, generator=gen)[:9].view(3, 3),
                               seq_lens=torch.tensor(lengths))
        q = torch.randn(3, shard.q_count, 64, generator=gen)
        out = attn._decode_kernel(q, meta, torch.zeros(3, dtype=torch.int64))
        assert out.shape == q.shape
        for b, n in enumerate(lengths):
            table = meta.block_tables[b:b + 1]
            keys = gather_blocks(attn.k_cache, table)[0, :n]
            values = gather_blocks(attn.v_cache, table)[0, :n]
            close(out[b:b + 1], per_head_reference(q[b:b + 1], keys, values, n - 1, attn.scale,
                                                   shard))


def test_a_shared_kv_head_is_attended_once_over_the_ranks_parts_of_the_rows():
    """SmolLM2's heads at tp 2 with KV head 1 split over sequences: each rank's operator call
    attends its own KV head for every row and the shared one's whole group for the rows of
    its part, zeros elsewhere; the parts cover every row once, balance a batch, and a row's
    part is its own (its length and input token), whatever else the batch holds."""
    from types import SimpleNamespace

    from braid.layers import decode_kernel
    from braid.layers.attention import PagedAttention, gather_blocks
    from braid.layers.partition import partition_heads

    assert decode_kernel.load()
    gen = torch.Generator().manual_seed(11)
    rows_in_batch = 32
    lengths = torch.randint(1, 49, (rows_in_batch,), generator=gen)
    tokens = torch.randint(0, 49152, (rows_in_batch,), generator=gen)
    tables = torch.randperm(3 * rows_in_batch, generator=gen).view(rows_in_batch, 3)
    attended_rows = []
    for shard in partition_heads(9, 3, 2):
        attn = PagedAttention(shard.held[1], shard.kv_count, 64, shard.runs(),
                              kv_parts=shard.kv_parts, own_offset=shard.own_offset)
        attn.allocate_cache(3 * rows_in_batch, 16, torch.float32, torch.device("cpu"),
                            KernelPlan(kv_layout=cache_layout(torch.float32, 16, 64)))
        fill_cache(attn, gen)
        q = torch.randn(rows_in_batch, shard.held[1], 64, generator=gen)
        out = attn._decode_kernel(q, SimpleNamespace(block_tables=tables, seq_lens=lengths),
                                  tokens)
        shared = [j for j, (_, parts) in enumerate(shard.kv_parts) if parts == 2]
        assert len(shared) == 1
        group = slice(shared[0] * 3, shared[0] * 3 + 3)
        rows = []
        for b, n in enumerate(lengths.tolist()):
            keys = gather_blocks(attn.k_cache, tables[b:b + 1])[0, :n]
            values = gather_blocks(attn.v_cache, tables[b:b + 1])[0, :n]
            expected = torch.cat([reference(q[b:b + 1, 3 * j:3 * j + 3], keys[:, j:j + 1],
                                            values[:, j:j + 1], n - 1, attn.scale)
                                  for j in range(shard.kv_count)], dim=1)
            if out[b, group].abs().sum() == 0:
                expected[:, group] = 0
            else:
                rows.append(b)
            close(out[b:b + 1], expected)
        # Each row alone, or in the batch reversed, gets the same output: its part is its own.
        for b in range(rows_in_batch):
            alone = attn._decode_kernel(q[b:b + 1], SimpleNamespace(
                block_tables=tables[b:b + 1], seq_lens=lengths[b:b + 1]), tokens[b:b + 1])
            assert torch.equal(alone[0], out[b])
        reversed_rows = attn._decode_kernel(q.flip(0), SimpleNamespace(
            block_tables=tables.flip(0), seq_lens=lengths.flip(0)), tokens.flip(0))
        assert torch.equal(reversed_rows.flip(0), out)
        attended_rows.append(rows)
    assert sorted(attended_rows[0] + attended_rows[1]) == list(range(rows_in_batch))
    assert all(8 <= len(rows) <= 24 for rows in attended_rows), attended_rows


# The int8 pair layout's kernel rounds the queries and softmax weights to int16 (2^-16 of a
# row's largest): an error of order 1e-4 on outputs of order 1, a hundredth of what storing
# the rows as int8 costs (0.4% of a row's largest).
PAIRED_TOLERANCE = {"atol": 3e-4, "rtol": 1e-3}


@pytest.mark.skipif(not _int8_pairs_fit(), reason="the int8 pair layout needs AVX512-VNNI")
def test_the_int8_pair_layout_reads_long_sequences_and_carries_nan():
    """Past 512 keys the pair kernel moves its int32 sums to fp32 (before they could
    overflow): a sequence of 1,100 keys whose values all share one sign and magnitude, under
    a zero query (equal weights: the largest sums), matches the reference, as it does under a
    random query; a NaN key row still gives NaN, as the fp32 path."""
    from braid.layers import decode_kernel, kv_layout
    from braid.layers.attention import gather_blocks, write_cache

    assert decode_kernel.load()
    gen = torch.Generator().manual_seed(0)
    attn = paged_attention(6, 2, 64, tokens_innermost=True, num_blocks=80, block_size=16,
                           dtype=torch.int8)
    assert kv_layout.is_paired(attn.k_cache)
    fill_cache(attn, gen)
    slots = torch.arange(80 * 16)
    write_cache(attn.v_cache, torch.full((len(slots), 2, 64), -3.0), slots, attn.v_scales)
    block_tables = torch.randperm(80, generator=gen)[:70].view(1, 70)
    lengths = torch.tensor([1100])
    keys = gather_blocks(attn.k_cache, block_tables, attn.k_scales, torch.float64)[0, :1100]
    values = gather_blocks(attn.v_cache, block_tables, attn.v_scales, torch.float64)[0, :1100]
    for q in (torch.zeros(1, 6, 64), torch.randn(1, 6, 64, generator=gen) * 4):
        out = decode_kernel.paged_decode_attention(q, attn.k_cache, attn.v_cache, block_tables,
                                                   lengths, 0.125, attn.k_scales, attn.v_scales)
        expected = reference(q, keys, values, 1099, 0.125)
        torch.testing.assert_close(out.double(), expected, **PAIRED_TOLERANCE)

    row = torch.randn(1, 2, 64, generator=gen)
    row[0, 1, 5] = float("nan")
    write_cache(attn.k_cache, row, block_tables[0, 3:4] * 16 + 7, attn.k_scales)
    out = decode_kernel.paged_decode_attention(q, attn.k_cache, attn.v_cache, block_tables,
                                               lengths, 0.125, attn.k_scales, attn.v_scales)
    assert out[0, 3:].isnan().all() and not out[0, :3].isnan().any()


def test_decode_kernel_refuses_an_int8_cache_without_its_scales():
    from braid.layers import decode_kernel

    assert decode_kernel.load()
    attn = paged_attention(4, 2, 16, tokens_innermost=True, num_blocks=4, block_size=16,
                           dtype=torch.int8)
    with pytest.raises(RuntimeError, match="int8 caches come with their scales"):
        decode_kernel.paged_decode_attention(torch.randn(1, 4, 16), attn.k_cache, attn.v_cache,
                                             torch.tensor([[1]]), torch.tensor([3]), 0.25)


def test_decode_kernel_refuses_lengths_its_block_table_does_not_hold():
    from braid.layers import decode_kernel

    assert decode_kernel.load()
    attn = paged_attention(4, 2, 16, tokens_innermost=True, num_blocks=4, block_size=16)
    q = torch.randn(1, 4, 16)
    for length in (0, 33):
        with pytest.raises(RuntimeError, match=f"sequence 0 has {length} keys, outside 1 to"):
            decode_kernel.paged_decode_attention(q, attn.k_cache, attn.v_cache,
                                                 torch.tensor([[1, 2]]), torch.tensor([length]),
                                                 0.25)


def test_decode_kernel_refuses_block_ids_outside_the_cache():
    from braid.layers import decode_kernel

    assert decode_kernel.load()
    attn = paged_attention(4, 2, 16, tokens_innermost=True, num_blocks=4, block_size=16)
    q = torch.randn(1, 4, 16)
    for table in ([[1, 4]], [[-1, 2]]):  # its second block, its first
        with pytest.raises(RuntimeError, match=r"reads block -?\d+ \(entry \d of its table\), "
                                               "outside the cache's 4 blocks"):
            decode_kernel.paged_decode_attention(q, attn.k_cache, attn.v_cache,
                                                 torch.tensor(table), torch.tensor([20]), 0.25)
    # entries past its length are not read, whatever they hold
    decode_kernel.paged_decode_attention(q, attn.k_cache, attn.v_cache, torch.tensor([[1, 99]]),
                                         torch.tensor([16]), 0.25)


def test_operators_that_cannot_be_built_warn(monkeypatch):
    """No compiler or no ninja: a warning, and the callers take their fallbacks (the traced
    decode kernel, ATen's norm, oneDNN's GEMMs on row-major weights, --comm torch)."""
    from braid import native

    def broken(announce):
        raise RuntimeError("ninja is required to load C++ extensions")

    monkeypatch.setattr(native, "_build", broken)
    monkeypatch.setattr(native, "_loaded", None)
    with pytest.warns(UserWarning, match="C.. operators not built.*ninja is required"):
        assert native.load() is False
    assert native.load() is False  # decided once per process


def test_a_nan_row_in_an_int8_cache_reads_back_as_nan():
    """NaN is not an int8 value: a row holding one stores a NaN scale, so what attends over it
    still sees NaN (and the engine's NaN check on the logits still fires)."""
    from braid.layers.attention import gather_blocks, write_cache

    attn = paged_attention(4, 2, 8, tokens_innermost=False, dtype=torch.int8)
    new = torch.randn(2, 2, 8)
    new[0, 1, 3] = float("nan")
    write_cache(attn.k_cache, new, torch.tensor([4, 5]), attn.k_scales)
    stored = gather_blocks(attn.k_cache, torch.tensor([[1]]), attn.k_scales, torch.float32)[0]
    assert stored[0, 1].isnan().all() and not stored[0, 0].isnan().any()
    assert not stored[1].isnan().any()


def _prefill_kernel_fits(head_dim: int = 64) -> bool:
    from braid.layers import decode_kernel

    return decode_kernel.prefill_fits(9, 3, head_dim, torch.bfloat16)


@pytest.mark.skipif(not _prefill_kernel_fits(), reason="the prefill operator needs AVX512-BF16")
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("tokens", "prefix", "head_dim"),
                         [(300, 0, 64), (45, 21, 64), (1, 130, 64), (128, 0, 128),
                          (7, 250, 32), (260, 300, 64)])
def test_prefill_kernel_matches_the_reference(heads, tokens, prefix, head_dim):
    """Query and key blocks that do and do not divide the tokens (128 each), with and without
    a prefix, two sequences; bf16 inputs against fp64 on the same (rounded) values."""
    from braid.layers import decode_kernel

    assert decode_kernel.load()
    gen = torch.Generator().manual_seed(tokens + prefix)
    hq, hk = heads
    q = torch.randn(2, tokens, hq, head_dim, generator=gen).bfloat16()
    keys, values = (torch.randn(2, prefix + tokens, hk, head_dim, generator=gen).bfloat16()
                    for _ in range(2))
    scale = head_dim ** -0.5
    out = decode_kernel.causal_prefill_attention(q, keys, values, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    for b in range(2):
        expected = reference(q[b], keys[b], values[b], prefix, scale)
        # softmax weights rounded to bf16 (2^-9) before the second GEMM, the output once more
        torch.testing.assert_close(out[b].double(), expected, atol=2e-2, rtol=2e-2)
        assert (out[b].double() - expected).abs().mean() < 2e-3


@pytest.mark.skipif(not _prefill_kernel_fits(), reason="the prefill operator needs AVX512-BF16")
def test_the_prefill_kernel_serves_a_rank_of_unequal_groups():
    """Both ranks of SmolLM2's heads at tp 2 (5 and 4 query heads, the middle KV head on
    both) prefill through the operator, one call per uniformly grouped run."""
    from braid.layers import decode_kernel
    from braid.layers.attention import PagedAttention
    from braid.layers.partition import partition_heads

    assert decode_kernel.load()
    gen = torch.Generator().manual_seed(5)
    for shard in partition_heads(9, 3, 2):
        attn = PagedAttention(shard.q_count, shard.kv_count, 64, shard.runs())
        assert len(attn.runs) == 2
        assert decode_kernel.prefill_fits(attn.padded_heads, attn.num_kv_heads, 64,
                                          torch.bfloat16)
        q = torch.randn(2, 150, shard.q_count, 64, generator=gen).bfloat16()
        keys, values = (torch.randn(2, 170, shard.kv_count, 64, generator=gen).bfloat16()
                        for _ in range(2))
        out = attn._by_runs(decode_kernel.causal_prefill_attention, q, keys, values, attn.scale)
        for b in range(2):
            expected = per_head_reference(q[b], keys[b], values[b], 20, attn.scale, shard)
            torch.testing.assert_close(out[b].double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not _prefill_kernel_fits(), reason="the prefill operator needs AVX512-BF16")
def test_prefill_kernel_raises_a_rows_max_when_later_keys_score_far_higher():
    """Keys that grow along the sequence: later key blocks' scores exceed what the first
    block set as a row's max by far more than the operator lets its weights grow, so rows
    are rescaled, some more than once."""
    from braid.layers import decode_kernel

    assert decode_kernel.load()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 400, 9, 64, generator=gen).bfloat16()
    growth = torch.linspace(0.1, 6.0, 400)[None, :, None, None]
    keys = (torch.randn(1, 400, 3, 64, generator=gen) * growth).bfloat16()
    values = torch.randn(1, 400, 3, 64, generator=gen).bfloat16()
    out = decode_kernel.causal_prefill_attention(q, keys, values, 0.125)
    expected = reference(q[0], keys[0], values[0], 0, 0.125)
    torch.testing.assert_close(out[0].double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not _prefill_kernel_fits(), reason="the prefill operator needs AVX512-BF16")
def test_prefill_kernel_refuses_what_it_cannot_compute():
    from braid.layers import decode_kernel
    from braid.layers.decode_kernel import causal_prefill_attention

    assert decode_kernel.load()
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16 q, k and v"):
        causal_prefill_attention(q.float(), q.float(), q.float(), 1.0)
    with pytest.raises(RuntimeError, match="head dim a multiple of 32"):
        causal_prefill_attention(q[..., :48], q[..., :48], q[..., :48], 1.0)
    with pytest.raises(RuntimeError, match="mismatched shapes"):
        causal_prefill_attention(q, q[:, :3], q[:, :3], 1.0)
    assert not _prefill_kernel_fits(48)
