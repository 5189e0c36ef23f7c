"""SIGTERM stops `braid serve` within 5 s wherever it is, and leaves nothing behind: no process
of its session (engine, ranks, inductor's compilers), no shared memory. Idle: the shared
server's teardown (conftest); while it compiles its steps at start, and under load (make
test-all): here; across two hosts: test_two_host_serving and test_two_host_stops."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_utils import ServerProcess, braid_server, start_server

STOP_WITHIN_S = 5.0


def stop_and_time(server: ServerProcess) -> float:
    """SIGTERM the server; seconds until it and every process it started are gone. Fails
    if that takes more than twice the budget, naming what is left."""
    segments = {pid: _segments(pid) for pid in (p.pid for p in server.session())}
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    while ((server.proc.poll() is None or server.session())
           and time.monotonic() - start < 2 * STOP_WITHIN_S):
        time.sleep(0.02)
    took = time.monotonic() - start
    left = server.session_names()
    assert not left, f"still running {took:.1f} s after SIGTERM: {left}\n{server.output()}"
    left_segments = [s for names in segments.values() for s in names if _exists(s)]
    assert not left_segments, left_segments
    return took


def _segments(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"braid-{pid}-")]


def _exists(segment: str) -> bool:
    return os.path.exists(f"/dev/shm/{segment}")


@pytest.mark.slow  # a cold compile
def test_sigterm_while_the_steps_compile_at_start(tiny_llama, tmp_path):
    """With cold caches the server compiles its steps before it answers; SIGTERM while g++
    runs for inductor stops the compile (the ranks are busy: they are not waited for) and the
    compilers with it, exit code 0."""
    cold = {"XDG_CACHE_HOME": str(tmp_path / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    server = start_server("--model", tiny_llama, "--tp", "2", "--compile", "on",
                          log_dir=tmp_path, env=cold)
    try:
        deadline = time.monotonic() + 240
        while not any(name.split(" ", 1)[1] in ("g++", "cc1plus")
                      for name in server.session_names()):
            assert server.proc.poll() is None, server.output()
            assert time.monotonic() < deadline, "no compiler ran:\n" + server.output()
            time.sleep(0.05)
        took = stop_and_time(server)
        assert took < STOP_WITHIN_S
        assert server.proc.returncode == 0, server.output()  # a stop asked for: a clean one
    finally:
        server.stop()


# make test-all (make test: under load across two hosts, test_two_host_serving's `served`)
@pytest.mark.slow
def test_sigterm_under_load_ends_every_stream(tiny_llama, tmp_path):
    """Eight long streams in flight: they get the grace period, then end with finish reason
    "abort" (none is lost), and the server is gone within the budget, exit code 0."""
    with braid_server("--model", tiny_llama, "--tp", "2", log_dir=tmp_path) as server, \
            ThreadPoolExecutor(8) as pool:
        started = []

        def stream() -> str | None:
            body = {"prompt": "Count to a million:", "max_tokens": 2000, "stream": True,
                    "ignore_eos": True}
            reason = None
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                              timeout=30) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        started.append(1)
                        reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
            return reason

        streams = [pool.submit(stream) for _ in range(8)]
        deadline = time.monotonic() + 60
        while len(started) < 64 and time.monotonic() < deadline:
            time.sleep(0.05)
        took = stop_and_time(server)
        assert [s.result(timeout=10) for s in streams] == ["abort"] * 8
        assert server.proc.returncode == 0, server.output()
        assert took < STOP_WITHIN_S
