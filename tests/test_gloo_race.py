"""Two-batch overlap keeps gathers in flight while others finish; over gloo that must not
corrupt a rank's heap. torch 2.13's gloo frees the heap buffer of a long operation name from
each worker thread that finishes one, unlocked (docs/gloo-race.md): braid's communicator gathers
through the operation whose name fits std::string's inline buffer. Two processes on 127.0.0.1
under glibc's heap checks (MALLOC_CHECK_=3, which aborts on a double free) keep gathers in flight
through braid's communicator; on the old gather path a process died within seconds."""

from __future__ import annotations

import multiprocessing

import pytest
import rank_targets
from server_utils import free_port

from braid.distributed.ranks.local import describe_exit

IN_FLIGHT = 16  # the repro's stress form: many works in flight widen the race's window


def stress(monkeypatch, seconds: float) -> None:
    monkeypatch.setenv("MALLOC_CHECK_", "3")  # the processes inherit it at their start
    context, port = multiprocessing.get_context("spawn"), free_port()
    processes = [context.Process(target=rank_targets.gathers_in_flight,
                                 args=(rank, port, seconds, IN_FLIGHT)) for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(seconds + 120)
    finally:
        for process in processes:
            process.kill()
    assert [p.exitcode for p in processes] == [0, 0], [
        describe_exit(p.exitcode) if p.exitcode is not None else "still running"
        for p in processes]


def test_gathers_in_flight_over_gloo_keep_the_heap_whole(monkeypatch):
    """On the old path a process died in 2-20 s (median about 10): this fails there more
    often than not, the slow variant always."""
    stress(monkeypatch, 12)


@pytest.mark.slow
def test_gathers_in_flight_over_gloo_keep_the_heap_whole_longer(monkeypatch):
    stress(monkeypatch, 120)
