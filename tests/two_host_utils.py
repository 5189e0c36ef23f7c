"""`braid serve --tp 2` across two emulated hosts (scripts/two_hosts.py): rank 0 and the API
on host 0, rank 1 on host 1, one torchrun agent each, for test_two_host_serving and
test_two_host_stops. Only one such server runs at a time: the namespaces are shared."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from two_hosts import TwoHosts, enter_namespace, namespace_pids  # noqa: E402

PORT = 30000  # inside host 0's namespace, where nothing else listens
COMM_TIMEOUT_S = 10
START_TIMEOUT_S = 240
STOP_WITHIN_S = 5.0


def start_agents(hosts: TwoHosts, log_dir: Path, *args: str,
                 env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """`braid serve --tp 2` with rank 0 (and the API) on host 0, rank 1 on host 1: the two
    torchrun agents, not waited for."""
    serve = ["serve", "--tp", "2", "--host", TwoHosts.address(0), "--port", str(PORT),
             "--dtype", "fp32", "--compile", "off", "--comm-timeout", str(COMM_TIMEOUT_S),
             "--log-level", "warning", *args]
    agents = []
    for h in (0, 1):
        with open(log_dir / f"h{h}.log", "w") as log:
            agents.append(hosts.popen(h, hosts.torchrun_argv(h, serve), env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return agents


@contextmanager
def two_host_server(log_dir: Path, *args: str):
    """`start_agents` between two hosts at 1 Gbit/s, ready to answer; yields (hosts, the
    agents' processes, a client pool of threads inside host 0, the server's URL)."""
    with TwoHosts("1gbit") as hosts, ThreadPoolExecutor(
            16, initializer=enter_namespace, initargs=(0,)) as pool:
        agents = start_agents(hosts, log_dir, *args)
        url = f"http://{hosts.address(0)}:{PORT}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        deadline = time.monotonic() + START_TIMEOUT_S
        while not pool.submit(healthy).result():
            if agents[0].poll() is not None or time.monotonic() > deadline:
                pytest.fail("the two-host server did not start:\n"
                            + (log_dir / "h0.log").read_text()[-3000:])
            time.sleep(0.5)
        yield hosts, agents, pool, url


def stop_and_time(agents: list[subprocess.Popen], log_dir: Path) -> float:
    """SIGTERM to the server (host 0's torchrun worker), as a service manager stops it;
    seconds until both hosts' agents have exited 0 and nothing runs in either namespace.
    Fails if that takes over twice the budget, naming what is left."""
    (server,) = psutil.Process(agents[0].pid).children()
    start = time.monotonic()
    server.send_signal(signal.SIGTERM)
    deadline = start + 2 * STOP_WITHIN_S
    while time.monotonic() < deadline and (
            any(agent.poll() is None for agent in agents)
            or namespace_pids(TwoHosts.namespace(0)) or namespace_pids(TwoHosts.namespace(1))):
        time.sleep(0.02)
    took = time.monotonic() - start
    left = {h: process_names(h) for h in (0, 1)}
    logs = "\n".join((log_dir / f"h{h}.log").read_text()[-2000:] for h in (0, 1))
    assert not any(left.values()), f"still running {took:.1f} s after SIGTERM: {left}\n{logs}"
    assert [agent.returncode for agent in agents] == [0, 0], logs
    return took


def process_names(host: int) -> list[str]:
    """The names of the processes inside host `host`'s namespace."""
    names = []
    for pid in namespace_pids(TwoHosts.namespace(host)):
        with contextlib.suppress(psutil.Error):
            names.append(psutil.Process(pid).name())
    return names


def long_stream(url: str, started: list) -> str | None:
    """A greedy stream far longer than the test waits; its finish reason."""
    body = {"prompt": "Count to a million:", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    reason = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                started.append(1)
                reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
    return reason
