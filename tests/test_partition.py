"""How heads, MLP columns and vocabulary are split over ranks, evenly or not."""

from __future__ import annotations

import pytest
import torch

from braid.errors import UserError
from braid.layers.partition import partition_heads, split_range, split_sizes
from braid.loader.gguf import unpermute_rotary


def test_split_sizes_puts_remainders_first():
    assert split_sizes(1536, 2) == [768, 768]
    assert split_sizes(49152, 5) == [9831, 9831, 9830, 9830, 9830]
    assert split_sizes(10, 3) == [4, 3, 3]
    assert [split_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]


def test_smollm_query_heads_split_evenly_at_tp2():
    # 9 query heads in 3 KV groups of 3: 5/4, KV head 1 (query heads 3-5) held by both ranks.
    shards = partition_heads(9, 3, 2)
    assert [(s.q_start, s.q_count, s.kv_start, s.kv_count) for s in shards] == [
        (0, 5, 0, 2), (5, 4, 1, 2)]
    # Rank 0 reads KV 0 with 3 heads and KV 1 with 2; rank 1 KV 1 with 1 and KV 2 with 3.
    assert shards[0].runs() == [(0, 3, 0, 1), (3, 2, 1, 1)]
    assert shards[1].runs() == [(0, 1, 0, 1), (1, 3, 1, 1)]


def test_a_shared_kv_head_is_split_over_sequences_where_each_rank_has_its_own():
    # SmolLM2 at tp 2: KV head 1 is read by both ranks; each holds its whole query group
    # (heads 3-5) and attends it over its part of the decode rows, so each reads 1.5 KV heads.
    shards = partition_heads(9, 3, 2)
    assert [s.kv_parts for s in shards] == [((0, 1), (0, 2)), ((1, 2), (0, 1))]
    assert [s.held for s in shards] == [(0, 6), (3, 6)]
    assert [s.own_offset for s in shards] == [0, 2]
    # No cut group, or a rank with no KV head of its own (one KV head for all, as Gemma 3
    # 1B at tp 2), or a rank that would hold more than a group beyond its own heads: as before.
    for heads, kv, tp in [(9, 3, 3), (32, 8, 2), (4, 1, 2), (9, 3, 4), (32, 8, 3)]:
        for s in partition_heads(heads, kv, tp):
            assert s.kv_parts == () and s.held == (s.q_start, s.q_count), (heads, kv, tp)


def test_whole_groups_are_one_run():
    assert [s.runs() for s in partition_heads(32, 8, 2)] == [[(0, 16, 0, 4)]] * 2
    assert partition_heads(9, 3, 4)[2].runs() == [(0, 2, 0, 2)]  # one head from each of two


def test_heads_even_split_at_tp3():
    shards = partition_heads(9, 3, 3)
    assert [(s.q_start, s.q_count, s.kv_start, s.kv_count) for s in shards] == [
        (0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]


def test_kv_heads_replicated_when_ranks_outnumber_them():
    shards = partition_heads(9, 3, 4)
    # 3/2/2/2 query heads: KV head 1 is read by ranks 1 and 2, KV head 2 by ranks 2 and 3.
    assert [(s.q_start, s.q_count, s.kv_start, s.kv_count) for s in shards] == [
        (0, 3, 0, 1), (3, 2, 1, 1), (5, 2, 1, 2), (7, 2, 2, 1)]
    shards = partition_heads(32, 8, 16)
    assert all(s.q_count == 2 and s.kv_count == 1 for s in shards)
    covered = sorted(q for s in shards for q in range(s.q_start, s.q_start + s.q_count))
    assert covered == list(range(32))


def test_every_query_head_is_owned_exactly_once():
    for heads, kv in [(9, 3), (12, 4), (14, 2), (8, 8)]:
        group = heads // kv
        for tp in range(1, heads + 1):
            shards = partition_heads(heads, kv, tp)
            owned = sorted(q for s in shards for q in range(s.q_start, s.q_start + s.q_count))
            assert owned == list(range(heads)), (heads, kv, tp)
            assert max(s.q_count for s in shards) - min(s.q_count for s in shards) <= 1
            for s in shards:  # the runs cover the rank's heads, each run uniformly grouped
                assert s.q_count > 0
                runs = s.runs()
                assert sum(qn for _, qn, _, _ in runs) == s.q_count
                assert sum(kn for _, _, _, kn in runs) == s.kv_count
                for q0, qn, k0, kn in runs:
                    assert qn % kn == 0
                    for q in range(q0, q0 + qn):  # each query head reads its own KV head
                        local_kv = k0 + (q - q0) // (qn // kn)
                        assert (s.q_start + q) // group == s.kv_start + local_kv


def test_no_valid_split_is_a_user_error():
    with pytest.raises(UserError, match="--tp 10"):
        partition_heads(9, 3, 10)
    with pytest.raises(UserError, match="multiple"):
        partition_heads(10, 3, 2)


def test_unpermute_rotary_inverts_llama_cpp_permutation():
    heads, head_dim, cols = 3, 8, 5
    w = torch.randn(heads * head_dim, cols)
    # llama.cpp's convert script: per head, rows (2, half) -> (half, 2).
    permuted = w.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rotary(permuted, heads), w)
    # Head by head, as a rank slices it.
    assert torch.equal(unpermute_rotary(permuted[head_dim:], heads - 1), w[head_dim:])


def test_the_split_printed_at_startup_names_each_ranks_heads(model_path):
    from braid.loader.model_config import load_model_config
    from braid.models.llama import LlamaForCausalLM

    config = load_model_config(model_path)
    assert LlamaForCausalLM.describe_split(config, 2) == (
        "rank 0: query heads 0-4 (KV 0-1; KV 1 split over sequences at decode, query heads "
        "0-5 held); rank 1: query heads 5-8 (KV 1-2; KV 1 split over sequences at decode, "
        "query heads 3-8 held); MLP columns 768/768; vocabulary rows 24576/24576")
    assert LlamaForCausalLM.describe_split(config, 3).startswith(
        "rank 0: query heads 0-2 (KV 0); rank 1: query heads 3-5 (KV 1);")
