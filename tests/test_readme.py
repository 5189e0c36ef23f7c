"""Every shell and Python block of the README runs as written, in README order, in one folder.

A block may be preceded by an HTML comment that says how it runs:
- none: run in `make test`;
- `<!-- doctest: slow -->`: run in `make test-all` only (benchmarks, evaluations, and
  examples whose commands `tests/test_cli.py` already runs in short form);
- `<!-- doctest: server -->`: each command starts a server that stays up for the blocks after
  it and must exit 0 on SIGTERM at the end; the test gives each a free port and points the
  later blocks' `127.0.0.1:PORT` addresses at it (tests never bind a fixed port);
- `<!-- doctest: skip REASON -->`: not run (it needs what this machine lacks), with the reason.
Python blocks are saved as a script and run, as a user pasting them would.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from server_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"  # the workspace's shared folder, for ../shared/data/mmlu
DEFAULT_PORT = 30000  # braid serve's default
SLOW_TIMEOUT_S = 3600  # a slow block (an evaluation, a benchmark loop) may run this long
_BLOCK = re.compile(r"(?:<!-- doctest: (?P<mode>\w+) ?(?P<reason>[^>]*?) -->\n)?"
                    r"^```(?P<lang>bash|python)\n(?P<code>.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str
    mode: str  # fast, slow, server or skip
    reason: str = ""


def readme_blocks() -> list[Block]:
    text = (ROOT / "README.md").read_text()
    blocks = []
    for match in _BLOCK.finditer(text):
        mode = match["mode"] or "fast"
        assert mode in ("fast", "slow", "server", "skip"), f"unknown doctest mode {mode!r}"
        blocks.append(Block(text.count("\n", 0, match.start("code")), match["lang"],
                            match["code"], mode, match["reason"]))
    return blocks


def commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """The folder blocks run in; `../shared` is the workspace's shared folder."""
    base = tmp_path_factory.mktemp("readme")
    (base / "work").mkdir()
    if SHARED.is_dir():
        (base / "shared").symlink_to(SHARED)
    return base / "work"


@pytest.fixture(scope="module")
def servers(sandbox):
    """README port -> (process, free port) of the servers started by server blocks; each is
    stopped with SIGTERM at the end and must exit 0."""
    running: dict[int, tuple[subprocess.Popen, int]] = {}
    try:
        yield running
    finally:
        for proc, _ in running.values():
            proc.send_signal(signal.SIGTERM)
        codes = {}
        for readme_port, (proc, _) in running.items():
            try:
                codes[readme_port] = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[readme_port] = "still running 60 s after SIGTERM"
        assert all(code == 0 for code in codes.values()), codes


def environment() -> dict[str, str]:
    """This interpreter's bin folder first on PATH, so `braid` is the one under test."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def start_server(command: str, sandbox: Path, servers: dict) -> None:
    """Start a server block's command on a free port; without `--compile` it serves eager, as
    `server_utils.braid_server` does (compiling the embedded model at start takes minutes)."""
    if "--compile" not in command:
        command += " --compile off"
    port = free_port()
    readme_port = DEFAULT_PORT
    match = re.search(r"--port (\d+)", command)
    if match:
        readme_port = int(match[1])
        command = command.replace(match[0], f"--port {port}")
    else:
        command += f" --port {port}"
    log = open(sandbox / f"server-{readme_port}.log", "w")  # noqa: SIM115 - the server's
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=sandbox, env=environment(),
                            stdout=log, stderr=subprocess.STDOUT)
    servers[readme_port] = (proc, port)
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, f"{command} exited:\n{(sandbox / log.name).read_text()}"
        assert time.monotonic() < deadline, f"{command} not healthy within 240 s"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)


def point_at_servers(code: str, servers: dict) -> str:
    """Replace each `127.0.0.1:PORT` with the address of the server started for PORT."""
    def replace(match: re.Match) -> str:
        readme_port = int(match[1])
        assert readme_port in servers, f"no server block before this one serves port {readme_port}"
        return f"127.0.0.1:{servers[readme_port][1]}"

    return re.sub(r"127\.0\.0\.1:(\d+)", replace, code)


def run_block(block: Block, sandbox: Path, servers: dict) -> None:
    code = point_at_servers(block.code, servers)
    if block.lang == "python":
        script = sandbox / f"readme_line_{block.line}.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", code]
    timeout = SLOW_TIMEOUT_S - 60 if block.mode == "slow" else 540
    proc = subprocess.run(argv, cwd=sandbox, env=environment(), capture_output=True, text=True,
                          timeout=timeout)
    report = f"README line {block.line}:\n{code}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert proc.stdout.strip(), report
    assert '"error"' not in proc.stdout, report  # a server's error body (curl exits 0)


def _param(block: Block):
    marks = [pytest.mark.slow, pytest.mark.timeout(SLOW_TIMEOUT_S)] if block.mode == "slow" else []
    return pytest.param(block, id=f"line{block.line}-{block.lang}-{block.mode}", marks=marks)


def test_the_readme_has_fast_slow_server_and_skipped_blocks():
    modes = [b.mode for b in readme_blocks()]
    assert {"fast", "slow", "server", "skip"} <= set(modes)
    assert all(b.reason for b in readme_blocks() if b.mode == "skip")


@pytest.mark.parametrize("block", [_param(b) for b in readme_blocks()])
def test_readme_block(block: Block, sandbox: Path, servers: dict):
    if block.mode == "skip":
        pytest.skip(block.reason)
    if "../shared/" in block.code and not SHARED.is_dir():
        pytest.skip(f"{SHARED} (the workspace's shared data) is not there")
    if block.mode == "server":
        for command in commands(block.code):
            start_server(command, sandbox, servers)
    else:
        run_block(block, sandbox, servers)
