"""The launcher: ranks run, and a rank that raises or dies brings the launch down quickly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import rank_targets
from driver_utils import driver_process, kill_and_wait_for_ranks

from braid.distributed.ranks import RankFailure
from braid.distributed.ranks.local import RANK_ENV, LocalRankGroup, cores_for_rank

TESTS = Path(__file__).parent


def test_cores_are_shared_out_per_rank():
    assert cores_for_rank(0, 2, [0, 1]) == [0]
    assert cores_for_rank(1, 2, [0, 1]) == [1]
    assert cores_for_rank(1, 2, [0, 1, 2, 3]) == [2, 3]
    assert cores_for_rank(2, 3, [0, 1]) == [0]  # oversubscribed: wraps around, one core each


def test_ranks_start_with_the_rank_environment_unless_the_user_set_it(monkeypatch):
    """libgomp's spin and glibc's malloc settings reach the ranks (they are read at start-up);
    a value the user exported wins, and the launching process's environment is left as it
    was."""
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "7")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    group = LocalRankGroup(1, rank_targets.report_environment, (list(RANK_ENV),))
    try:
        [seen] = group.gather(timeout=60)
    finally:
        group.close()
    assert seen == {**RANK_ENV, "MALLOC_MMAP_MAX_": "7"}
    assert "GOMP_SPINCOUNT" not in os.environ


@pytest.mark.slow  # make test: the other launch failures above and below
def test_a_rank_that_showed_a_progress_bar_leaves_no_semaphore_behind():
    """tqdm's default lock is a named semaphore that a rank's os._exit would leak: the
    resource tracker then warned at the launching process's exit."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import rank_targets
        from braid.distributed.ranks.local import LocalRankGroup
        if __name__ == "__main__":
            group = LocalRankGroup(1, rank_targets.show_a_progress_bar)
            print(group.gather(timeout=60))
            group.close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "shown" in proc.stdout, proc.stderr
    assert "leaked semaphore" not in proc.stderr


def test_ranks_run_collectives_and_stop_cleanly():
    group = LocalRankGroup(2, rank_targets.echo)
    assert group.gather(timeout=60) == ["ready", "ready"]
    group.send_all(("value", 3))
    assert group.gather(timeout=30) == [(0, 6.0), (1, 6.0)]
    pids = [p.pid for p in group.procs]
    group.close()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in pids)


def test_a_rank_that_raises_fails_the_launch_within_10s():
    group = LocalRankGroup(2, rank_targets.raise_on_rank_1)
    group.gather(timeout=60)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="injected failure on rank 1"):
        group.request(("go", None))
    assert time.monotonic() - start < 10
    assert all(not p.is_alive() for p in group.procs)


def test_a_killed_rank_fails_the_launch():
    group = LocalRankGroup(2, rank_targets.echo)
    group.gather(timeout=60)
    os.kill(group.procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"^rank 1 died \(killed by SIGKILL\)"):
        group.request(("value", 1))
    assert time.monotonic() - start < 10
    assert all(not p.is_alive() for p in group.procs)


def test_the_launching_process_exits_nonzero_within_10s():
    script = textwrap.dedent("""
        import sys, time
        sys.path.insert(0, {tests!r})
        import rank_targets
        from braid.distributed.ranks import RankFailure
        from braid.distributed.ranks.local import LocalRankGroup
        if __name__ == "__main__":
            group = LocalRankGroup(2, rank_targets.raise_on_rank_1)
            group.gather()
            print("go", time.monotonic(), flush=True)
            group.request(("go", None))
    """).format(tests=str(TESTS))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    ended = time.monotonic()
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr
    started = float(proc.stdout.split()[1])
    assert ended - started < 10


@pytest.mark.slow  # make test: the other launch failures above and below
def test_ranks_outlive_the_thread_that_started_them():
    """Parent-death signals are per thread: ranks started from a thread that has ended must
    keep serving (and still stop when the process that owns them does)."""
    import threading

    box = {}
    starter = threading.Thread(
        target=lambda: box.update(group=LocalRankGroup(2, rank_targets.echo)))
    starter.start()
    starter.join()
    group = box["group"]
    try:
        assert group.gather(timeout=60) == ["ready", "ready"]
        time.sleep(1.0)  # a parent-death signal would have fired by now
        group.send_all(("value", 2))
        assert group.gather(timeout=30) == [(0, 4.0), (1, 4.0)]
    finally:
        group.close()


def test_ranks_exit_when_their_driver_is_killed():
    script = textwrap.dedent("""
        import sys, time
        sys.path.insert(0, {tests!r})
        import rank_targets
        from braid.distributed.ranks.local import LocalRankGroup
        if __name__ == "__main__":
            group = LocalRankGroup(2, rank_targets.echo)
            group.gather()
            print(*[p.pid for p in group.procs], flush=True)
            time.sleep(600)
    """).format(tests=str(TESTS))
    with driver_process(script) as (driver, pids):
        kill_and_wait_for_ranks(driver, pids, within_s=5)


def test_a_rank_killed_during_generate_is_named_first_with_its_signal():
    """Rank 0 is spinning in a shared-memory collective when rank 1 is killed: the launcher
    stops it (SIGTERM), and the report names rank 1 first, then rank 0, then the segment."""
    from braid import LLM, SamplingParams

    llm = LLM(tp=2, comm="shm")
    try:
        os.kill(llm.core.executor.ranks.procs[1].pid, signal.SIGKILL)
        with pytest.raises(RankFailure) as failure:
            llm.generate("Hi", SamplingParams(max_new_tokens=64, ignore_eos=True))
    finally:
        llm.close()
    lines = str(failure.value).splitlines()
    assert lines[0] == "rank 1 died (killed by SIGKILL)"
    assert lines[1].startswith("rank 0 was stopped by the launcher (")
    assert re.fullmatch(r"shared memory /dev/shm/\S+ removed", lines[-1])
    assert not os.path.exists(lines[-1].split()[2])


@pytest.mark.slow  # make test: the other launch failures above and below
def test_a_script_without_the_main_guard_gets_a_clear_error(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text("from braid import LLM\n\nLLM(tp=2)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert proc.returncode != 0
    assert "braid.errors.UserError" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr
    assert "bootstrapping phase" not in proc.stderr  # multiprocessing's own message
    assert re.search(r"rank \d died \(while starting, exited with code 1", proc.stderr)


def test_rank_processes_import_only_what_they_need():
    """A rank imports the main module (`braid.cli` for the command) and the worker with its
    weight loading; none of the front end (tokenizer, server, plots) or GGUF parsing."""
    script = textwrap.dedent("""
        import sys
        import braid.cli, braid.worker.worker, braid.loader.weight_cache, braid.loader.safetensors
        heavy = ("transformers", "tokenizers", "gguf", "fastapi", "uvicorn", "matplotlib",
                 "openai", "httpx", "prometheus_client")
        print(" ".join(m for m in heavy if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == []
