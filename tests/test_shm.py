"""The shared-memory backend: same results as torch.distributed, split phase, timeouts, cleanup."""

from __future__ import annotations

import glob
import os
import signal

import pytest
import rank_targets

from braid.distributed.launch import RankFailure, RankGroup
from braid.distributed.shm import SEGMENT_PREFIX, SHM_DIR, ShmSegment


def segments() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIR, SEGMENT_PREFIX + "*")))


def launch(world_size, target, **segment_args):
    segment = ShmSegment.create(world_size, **segment_args)
    group = RankGroup(world_size, target, (segment,), cleanup=segment.unlink)
    return group, segment


@pytest.mark.parametrize("world_size", [2, 3])
def test_results_equal_torch_distributed(world_size):
    # 4 KiB slots: sizes up to five slots exercise chunking.
    group, _ = launch(world_size, rank_targets.shm_against_gloo, num_slots=4, slot_bytes=4096)
    try:
        assert group.gather(timeout=120) == [[]] * world_size
    finally:
        group.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_four_outstanding_operations_complete_in_order(world_size):
    group, _ = launch(world_size, rank_targets.shm_outstanding, num_slots=4, slot_bytes=4096)
    try:
        assert group.gather(timeout=60) == [True] * world_size
    finally:
        group.close()


def test_a_collective_longer_than_the_ring_beside_an_outstanding_one_completes():
    """The deadlock of two-batch overlap with long prompt logprobs: 12 chunks through 4 slots
    while another micro-batch's all-reduce holds one of them."""
    group, _ = launch(2, rank_targets.shm_chunked_beside_outstanding, num_slots=4,
                      slot_bytes=4096)
    try:
        assert group.gather(timeout=60) == [True, True]
    finally:
        group.close()


def test_a_missing_rank_times_out_with_its_name():
    group, _ = launch(2, rank_targets.shm_rank_1_absent)
    try:
        message = group.recv(0, timeout=60)
    finally:
        group.close()
    assert "rank(s) 1 did not publish" in message


def test_no_segment_remains_after_a_normal_run():
    before = segments()
    group, segment = launch(2, rank_targets.shm_then_raise)
    assert segment.path in segments()
    group.gather(timeout=60)
    group.close()
    assert segments() == before - {segment.path}


def test_no_segment_remains_after_an_exception_in_a_rank():
    before = segments()
    group, _ = launch(2, rank_targets.shm_then_raise)
    group.gather(timeout=60)
    with pytest.raises(RankFailure, match="injected failure"):
        group.request(("go", None))
    assert segments() <= before


def test_no_segment_remains_after_a_rank_is_killed():
    before = segments()
    group, _ = launch(2, rank_targets.shm_then_raise)
    group.gather(timeout=60)
    os.kill(group.procs[1].pid, signal.SIGKILL)
    with pytest.raises(RankFailure, match="rank 1 died"):
        group.request(("go", None))
    assert segments() <= before
