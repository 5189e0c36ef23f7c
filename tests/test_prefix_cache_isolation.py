"""The prefix cache serves a block only to a prompt with the same tokens: keys are salted
SHA-256 chains that differ per cache and per `cache_salt`, and every hit compares the block's
tokens, so a colliding key serves nothing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from engine_utils import fake_core, run_requests

from braid.config import KVCacheConfig
from braid.engine import kv_cache
from braid.engine.kv_cache import BlockManager
from braid.engine.request import Request, SamplingParams, Sequence

BS = 16
RNG = np.random.default_rng(1)
_ids = itertools.count()


def tokens(n: int) -> list[int]:
    return RNG.integers(1, 999, n).tolist()


def prefill(blocks: BlockManager, prompt: list[int], cache_salt: str | None = None
            ) -> tuple[Sequence, list[int]]:
    """Admit a prompt as the scheduler does, compute it whole and publish its blocks; the
    sequence and the cached blocks it was given."""
    seq = Sequence(next(_ids), "r", 0, list(prompt), SamplingParams(cache_salt=cache_salt))
    matched = blocks.match_prefix(seq)
    seq.blocks = matched + blocks.allocate(blocks.blocks_needed(seq.num_tokens, len(matched)))
    seq.num_computed = seq.num_tokens
    blocks.register(seq)
    return seq, matched


@pytest.fixture
def colliding(monkeypatch):
    """Every block's digest is the same: only the token comparison tells blocks apart."""
    monkeypatch.setattr(kv_cache, "block_key", lambda parent, tokens: bytes(32))


def test_a_colliding_key_never_serves_another_prompts_block(colliding):
    blocks = BlockManager(KVCacheConfig(1024, BS))
    first, second = tokens(2 * BS), tokens(2 * BS)
    a, _ = prefill(blocks, first + [1])
    b = Sequence(next(_ids), "r", 0, second + [1], SamplingParams())
    assert blocks.cached_prefix(blocks.shareable_keys(b)) == 0
    assert blocks.match_prefix(b) == []
    # Same first block, other second block: only the first is shared.
    c, matched = prefill(blocks, first[:BS] + second[BS:] + [1])
    assert matched == a.blocks[:1]
    # The colliding prompts published their own blocks, and each finds its own.
    for seq in (a, c):
        _, matched = prefill(blocks, seq.prompt_ids)
        assert matched == seq.blocks[:2]


def test_colliding_keys_change_no_engine_output(colliding):
    shared, x, y = tokens(2 * BS), tokens(40), tokens(40)
    other = tokens(2 * BS)
    prompts = [shared + x, other + x, shared + y]
    core, _ = fake_core()
    outputs = run_requests(core, prompts, SamplingParams(max_new_tokens=8, temperature=0))
    reference, _ = fake_core(prefix_caching=False)
    assert outputs == run_requests(reference, prompts,
                                   SamplingParams(max_new_tokens=8, temperature=0))
    assert core.scheduler.prefix_hits == 2 * BS  # the third prompt's `shared` blocks only


def test_keys_are_salted_per_cache():
    prompt = tokens(3 * BS + 1)
    one, two = BlockManager(KVCacheConfig(1024, BS)), BlockManager(KVCacheConfig(1024, BS))

    def keys(blocks):
        return blocks.shareable_keys(Sequence(next(_ids), "r", 0, prompt, SamplingParams()))

    assert keys(one) == keys(one) and len(set(keys(one))) == 3
    assert not set(keys(one)) & set(keys(two))


def test_cache_salt_isolates_prompts():
    blocks = BlockManager(KVCacheConfig(1024, BS))
    prompt = tokens(3 * BS + 5)
    first, _ = prefill(blocks, prompt, cache_salt="tenant-a")
    for salt in ("tenant-b", None, ""):
        _, matched = prefill(blocks, prompt, cache_salt=salt)
        assert matched == [], salt
    _, matched = prefill(blocks, prompt, cache_salt="tenant-a")
    assert matched == first.blocks[:3]
    # No salt shares with no salt (the run above published its blocks).
    _, matched = prefill(blocks, prompt)
    assert len(matched) == 3


def test_cache_salt_isolates_engine_requests():
    prompt = tokens(5 * BS)
    core, _ = fake_core()
    for salt in ("a", "b", "a"):
        params = SamplingParams(max_new_tokens=2, temperature=0, cache_salt=salt)
        core.add(Request(salt, prompt, params))
        while core.has_work:
            core.step()
    assert core.scheduler.prefix_hits == 4 * BS  # the second "a" only


def test_prompts_with_a_common_prefix_share_its_full_blocks():
    blocks = BlockManager(KVCacheConfig(1024, BS))
    prefix = tokens(2 * BS)
    first, matched = prefill(blocks, prefix + tokens(BS + 3))
    assert matched == []
    second, matched = prefill(blocks, prefix + tokens(BS + 3))
    assert matched == first.blocks[:2] and second.blocks[2] != first.blocks[2]
    assert blocks.shareable_keys(second)[:2] == blocks.shareable_keys(first)[:2]
    # The last token is always computed: a prompt of exactly the cached blocks shares one less.
    _, matched = prefill(blocks, prefix)
    assert matched == first.blocks[:1]
