"""The shared-memory backend: same results as torch.distributed, split phase, timeouts, cleanup."""

from __future__ import annotations

import errno
import glob
import os
import platform
import re
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import rank_targets
import torch
from conftest import slow
from driver_utils import driver_process, kill_and_wait_for_ranks

from braid.config import EngineConfig, resolve_comm
from braid.distributed.ranks import RankFailure
from braid.distributed.ranks.local import LocalRankGroup
from braid.distributed.shm import SEGMENT_PREFIX, ShmSegment, shm_dir
from braid.errors import UserError

BRAID = Path(sys.executable).with_name("braid")


def segments() -> set[str]:
    return set(glob.glob(os.path.join(shm_dir(), SEGMENT_PREFIX + "*")))


def launch(world_size, target, **segment_args):
    segment = ShmSegment.create(world_size, **segment_args)
    group = LocalRankGroup(world_size, target, (segment,), cleanup=segment.unlink)
    return group, segment


@pytest.mark.parametrize("world_size", [2, 3])
def test_results_equal_torch_distributed(world_size):
    # 4 KiB slots: sizes up to five slots exercise chunking.
    group, _ = launch(world_size, rank_targets.shm_against_gloo, num_slots=4, slot_bytes=4096)
    try:
        assert group.gather(timeout=120) == [[]] * world_size
    finally:
        group.close()


@pytest.mark.parametrize("world_size", [2, slow(3)])
def test_block_sums_into_the_residual_equal_torch_distributed(world_size):
    group, _ = launch(world_size, rank_targets.shm_reduce_into_against_gloo, num_slots=4,
                      slot_bytes=4096)
    try:
        assert group.gather(timeout=120) == [[]] * world_size
    finally:
        group.close()


@pytest.mark.parametrize("world_size", [2, slow(3)])
def test_block_sums_round_once(world_size):
    """Rounded once, as `(a.float() + b.float() + residual.float()).to(dtype)`: rounding the
    ranks' sum before adding the residual moved tp 2's bf16 logits off transformers' (see
    docs/correctness.md, "Rounding in bf16")."""
    group, _ = launch(world_size, rank_targets.shm_block_sum_rounds_once, num_slots=4,
                      slot_bytes=1 << 20)
    try:
        assert group.gather(timeout=120) == [[]] * world_size
    finally:
        group.close()


@pytest.mark.parametrize("world_size", [2, slow(3)])
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


def test_the_segment_is_unlinked_once_every_rank_has_mapped_it():
    before = segments()
    group, segment = launch(2, rank_targets.shm_then_raise)
    try:
        group.gather(timeout=60)  # both ranks mapped it and ran a collective
        assert segment.path not in segments()
        group.send_all(("go", None))
    finally:
        group.close()
    assert segments() <= before


def test_no_segment_remains_after_the_driver_is_killed():
    """SIGKILL leaves the driver no chance to clean up: the file must be gone already."""
    script = textwrap.dedent("""
        import time
        from braid import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM(tp=2, comm="shm")
            llm.generate("Hi", SamplingParams(max_new_tokens=2))
            print(*[p.pid for p in llm.core.executor.ranks.procs], flush=True)
            time.sleep(600)
    """)
    before = segments()
    with driver_process(script) as (driver, pids):
        assert len(pids) == 2
        assert segments() <= before  # unlinked while the ranks run
        kill_and_wait_for_ranks(driver, pids, within_s=10)
    assert segments() <= before


@pytest.mark.slow  # make test: the driver and a rank killed
def test_no_segment_remains_after_the_driver_is_killed_while_ranks_start():
    """The ranks unlink the segment once they have all mapped it; a driver killed before then
    (SIGKILL here; a SIGTERM, as `timeout` sends, skips its cleanup too) leaves the ranks to
    remove it as they exit."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import rank_targets
        from braid.distributed.ranks.local import LocalRankGroup
        from braid.distributed.shm import ShmSegment
        if __name__ == "__main__":
            segment = ShmSegment.create(2)
            group = LocalRankGroup(2, rank_targets.hold_segment_unmapped, (segment,),
                              cleanup=segment.unlink)
            group.gather(timeout=60)
            print(*[p.pid for p in group.procs], flush=True)
            time.sleep(600)
    """)
    before = segments()
    with driver_process(script) as (driver, pids):
        assert len(pids) == 2
        assert len(segments() - before) == 1  # the ranks have not mapped it
        kill_and_wait_for_ranks(driver, pids, within_s=10)
    assert segments() <= before


def test_a_segment_larger_than_the_free_shared_memory_is_refused_clearly():
    stat = os.statvfs(shm_dir())
    free = stat.f_bavail * stat.f_frsize
    before = segments()
    with pytest.raises(UserError, match=r"needs \d+ MiB in .* use --comm torch"):
        ShmSegment.create(2, num_slots=2, slot_bytes=free // 4 + (1 << 20))
    assert segments() == before


def test_a_failed_reservation_is_a_clear_error(monkeypatch):
    """Free space can vanish between the check and the reservation (another launch)."""
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    before = segments()
    with pytest.raises(UserError, match="reserving it failed: No space left on device"):
        ShmSegment.create(2)
    assert segments() == before


def test_braid_on_a_small_tmpfs_says_what_to_do(tmp_path):
    """A 4 MiB tmpfs (as a container's small /dev/shm): the command fails with one clear
    line, no SIGBUS and no traceback."""
    folder = tmp_path / "shm"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
            capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        proc = subprocess.run(
            [str(BRAID), "generate", "--tp", "2", "--comm", "shm", "--max-new-tokens", "1", "Hi"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "BRAID_SHM_DIR": str(folder)})
    finally:
        subprocess.run(["umount", str(folder)], check=True)
    assert proc.returncode != 0
    assert re.search(rf"error: --comm shm needs \d+ MiB in {folder} for 2 ranks, and 4 MiB are "
                     "free", proc.stderr)
    assert "use --comm torch" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_shm_is_refused_where_stores_are_not_totally_ordered(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert resolve_comm() == "torch"
    assert EngineConfig.create(model="m.gguf", tp=2).parallel.comm == "torch"
    with pytest.raises(UserError, match="x86 total store order.*--comm torch"):
        EngineConfig.create(model="m.gguf", tp=2, comm="shm")
    with pytest.raises(UserError, match="x86 total store order"):
        ShmSegment.create(2)


@pytest.mark.slow  # make test: slot reuse in test_four_outstanding_operations_complete_in_order
def test_long_prompt_logits_with_overlap_do_not_deadlock(model_path):
    """The report's reproduction, scaled down: 1,000 prompt positions' logits (half the
    vocabulary per rank, fp32) are gathered in 24 chunks of the smallest slot (4 MiB, for 1,024
    batched tokens) through an 8-slot ring while the other micro-batch holds a slot. Without
    the fix (a post reusing the next slot whether or not this rank still holds it) this ended
    in `ShmTimeout: ... did not release #130`, as the report's 3,000 positions did."""
    from braid import LLM

    prompt = [list(range(1, 1001))]
    with LLM(model_path, tp=1, dtype="fp32") as llm:
        reference = llm.prompt_logits(prompt)[0]
    with LLM(model_path, tp=2, dtype="fp32", comm="shm", overlap="on",
             max_num_batched_tokens=1024) as llm:
        logits = llm.prompt_logits(prompt)[0]
    assert logits.shape == reference.shape == (1000, 49152)
    # fp32 sums in another order: near ties may swap, nothing else moves
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.999
    assert (logits - reference).abs().max() < 1e-2


@pytest.mark.slow  # make test: the driver and a rank killed
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


@pytest.mark.parametrize("sequence", [torch.empty(0, dtype=torch.long),
                                      torch.zeros(2, dtype=torch.long),
                                      torch.zeros(1, dtype=torch.int32)])
def test_the_operators_refuse_a_sequence_record_cannot_write(sequence):
    """Each operator writes its ring's latest operation into `sequence`'s one element: any
    other tensor is refused before anything is posted (an empty one was written past)."""
    from braid import native

    if not native.load():
        pytest.skip("braid's C++ operators are not built on this host")
    x = torch.zeros(4)
    for call in (lambda: torch.ops.braid.shm_post(x, sequence, 0),
                 lambda: torch.ops.braid.shm_all_reduce(x, x, None, sequence, 0),
                 lambda: torch.ops.braid.shm_all_gather(x, x, [4], True, sequence, 0)):
        with pytest.raises(RuntimeError, match="sequence must be a one-element int64"):
            call()


def test_a_ring_refuses_a_thread_other_than_the_one_that_opened_it():
    """A ring's bookkeeping (operation numbers, held slots) is unlocked: only the thread that
    opened it may post or wait on it; any other gets an error, before anything is posted."""
    from braid import native

    if not native.load():
        pytest.skip("braid's C++ operators are not built on this host")
    slots, slot_bytes = 4, 1024
    memory = torch.zeros((slots + 1) * 64 + slots * slot_bytes, dtype=torch.uint8)
    ring = torch.ops.braid.shm_open(memory.data_ptr(), 1, 0, slots, slot_bytes, 5.0)
    x, sequence = torch.ones(4), torch.zeros(1, dtype=torch.long)
    try:
        with ThreadPoolExecutor(1) as other:
            posted = other.submit(torch.ops.braid.shm_post, x, sequence, ring)
            with pytest.raises(RuntimeError, match="thread other than the one that opened it"):
                posted.result()
        ticket = torch.ops.braid.shm_post(x, sequence, ring)  # the opening thread's: it works
        total = torch.ops.braid.shm_all_reduce(ticket, x, None, sequence, ring)
        torch.testing.assert_close(total, x)
        assert sequence.item() == 1  # the refused post took no operation number
    finally:
        torch.ops.braid.shm_close(ring)
