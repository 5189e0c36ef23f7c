"""Start and stop `braid serve` for tests: 127.0.0.1 only, a free port, always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A running `braid serve` subprocess and where to reach it."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = log

    def output(self) -> str:
        return self.log.read_text()

    def engine_and_ranks(self) -> tuple[psutil.Process, list[psutil.Process]]:
        """The engine process (the server's child) and the rank processes (its children)."""
        def spawned(proc: psutil.Process) -> list[psutil.Process]:
            children = [c for c in proc.children() if "spawn_main" in " ".join(c.cmdline())]
            return sorted(children, key=lambda c: c.create_time())

        (engine,) = spawned(psutil.Process(self.proc.pid))
        return engine, spawned(engine)

    def session(self) -> list[psutil.Process]:
        """The processes of the server's session that still run: the server, its engine,
        ranks and their compilers."""
        return session_processes(self.proc.pid)

    def session_names(self) -> list[str]:
        """"PID NAME" of each process of the session that still runs (a compiler that ends
        while it is listed is left out)."""
        names = []
        for proc in self.session():
            with contextlib.suppress(psutil.Error):
                names.append(f"{proc.pid} {proc.name()}")
        return names

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Signal the server and wait for it; kill it if it does not stop in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        kill_session(self.proc.pid)  # what a server killed here left behind
        return self.proc.returncode


def session_processes(sid: int) -> list[psutil.Process]:
    """The processes of session `sid` that still run (zombies excluded). braid's engine and
    ranks lead process groups of their own, but stay in the session of the command that
    started them."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def kill_session(sid: int) -> None:
    """SIGKILL every process left in session `sid`."""
    for proc in session_processes(sid):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def shm_segments_of(pid: int) -> list[str]:
    """Shared-memory segments created by process `pid` (braid names them braid-PID-...)."""
    return [p for p in os.listdir("/dev/shm") if p.startswith(f"braid-{pid}-")]


def start_server(*args: str, log_dir: Path, env: dict[str, str] | None = None) -> ServerProcess:
    """Start `braid serve ARGS` on a free port of 127.0.0.1 without waiting for it, in a
    session of its own: every process it starts, compilers included, is then found by
    `ServerProcess.left_behind`. Without `--compile` in ARGS it serves eager: a server
    compiles the embedded model's steps at start by default (minutes, cold), which the tests
    of the API do not need (test_server's compiled-start test serves a small model with the
    default)."""
    if "--compile" not in args:
        args = (*args, "--compile", "off")
    port = free_port()
    log = log_dir / f"server-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "braid.cli", "serve", "--host", "127.0.0.1", "--port",
             str(port), "--log-level", "warning", *args], stdout=out, stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env}, start_new_session=True)
    return ServerProcess(proc, port, log)


@contextmanager
def braid_server(*args: str, log_dir: Path, env: dict[str, str] | None = None):
    """`braid serve ARGS` (see `start_server`), ready to answer; stopped afterwards whatever
    happens."""
    server = start_server(*args, log_dir=log_dir, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"braid serve exited with {server.proc.returncode}:\n"
                                   f"{server.output()}")
            try:
                if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"braid serve did not start:\n{server.output()}")
            time.sleep(0.5)
        yield server
    finally:
        server.stop()
