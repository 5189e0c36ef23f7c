"""The README and every page under docs/ stay true: each shell and Python block runs as written,
the command-line reference is what the parser says, and every link lands.

Blocks run page by page: the blocks of one page in the page's order, in one folder of their
own (`../shared` is the workspace's shared folder), with servers of their own. A block may be
preceded by an HTML comment that says how it runs:
- none: run in `make test`;
- `<!-- doctest: slow -->`: run in `make test-all` only (benchmarks, evaluations, and
  examples whose commands `tests/test_cli.py` already runs in short form, or whose Python
  calls the tests make: the README's `LLM(tp=2, dtype="fp32")` is `tests/test_hf_parity.py`'s);
- `<!-- doctest: server -->`: each command starts a server that stays up for the page's blocks
  after it and must exit 0 on SIGTERM once the page's last selected block ran; the test gives
  each a free port and points the later blocks' `127.0.0.1:PORT` addresses at it (tests never
  bind a fixed port). A server block whose every client block is slow (or skipped) is slow too:
  `make test` starts no server that nothing of `make test` uses;
- `<!-- doctest: skip REASON -->`: not run, with the reason: it needs what this machine lacks
  (root, a second machine, a package braid does not depend on), or it is a measurement session
  longer than a test may take, whose commands run in short form in a slow block.
Python blocks are saved as a script and run, as a user pasting them would.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from server_utils import free_port, kill_session

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"  # the workspace's shared folder, for ../shared/data/mmlu
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
DEFAULT_PORT = 30000  # braid serve's default
SLOW_TIMEOUT_S = 3600  # a slow block (an evaluation, a benchmark loop) may run this long
_BLOCK = re.compile(r"(?:<!-- doctest: (?P<mode>\w+) ?(?P<reason>[^>]*?) -->\n)?"
                    r"^```(?P<lang>bash|python)\n(?P<code>.*?)^```", re.S | re.M)
_ADDRESS = re.compile(r"127\.0\.0\.1:(\d+)")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    mode: str  # fast, slow, server or skip
    reason: str = ""
    slow: bool = False  # runs in `make test-all` only

    @property
    def id(self) -> str:
        return f"{Path(self.page).name}:{self.line}-{self.lang}-{self.mode}"


def page_blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    found = []
    for match in _BLOCK.finditer(text):
        mode = match["mode"] or "fast"
        assert mode in ("fast", "slow", "server", "skip"), \
            f"{page}: unknown doctest mode {mode!r}"
        found.append(Block(page, text.count("\n", 0, match.start("code")), match["lang"],
                           match["code"], mode, match["reason"], mode == "slow"))
    blocks = []
    for i, block in enumerate(found):
        if block.mode == "server":
            ports = server_ports(block.code)
            clients = [b for b in found[i + 1:]
                       if {int(p) for p in _ADDRESS.findall(b.code)} & ports]
            if clients and all(b.mode in ("slow", "skip") for b in clients):
                block = Block(block.page, block.line, block.lang, block.code, block.mode,
                              block.reason, slow=True)
        blocks.append(block)
    return blocks


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)]


def commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def server_port(command: str) -> int:
    """The port a server command names (braid serve's default if none)."""
    match = re.search(r"--port (\d+)", command)
    return int(match[1]) if match else DEFAULT_PORT


def server_ports(code: str) -> set[int]:
    return {server_port(command) for command in commands(code)}


def environment() -> dict[str, str]:
    """This interpreter's bin folder first on PATH, so `braid` is the one under test."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


@dataclass
class Page:
    """One page's folder and the servers its server blocks started (page port -> process,
    free port)."""

    sandbox: Path
    servers: dict[int, tuple[subprocess.Popen, int]] = field(default_factory=dict)

    def stop_servers(self) -> dict[int, object]:
        """SIGTERM to every server; the exit codes that are not 0."""
        for proc, _ in self.servers.values():
            proc.send_signal(signal.SIGTERM)
        codes = {}
        for page_port, (proc, _) in self.servers.items():
            try:
                codes[page_port] = proc.wait(60)
            except subprocess.TimeoutExpired:
                codes[page_port] = "still running 60 s after SIGTERM"
            kill_session(proc.pid)
        self.servers.clear()
        return {port: code for port, code in codes.items() if code != 0}


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """Each page's folder, made when its first block runs; servers left running at the end
    (a page whose last block failed) are stopped."""
    made: dict[str, Page] = {}

    def page(name: str) -> Page:
        if name not in made:
            base = tmp_path_factory.mktemp(Path(name).stem)
            (base / "work").mkdir()
            if SHARED.is_dir():
                (base / "shared").symlink_to(SHARED)
            made[name] = Page(base / "work")
        return made[name]

    yield page
    failed = {name: p.stop_servers() for name, p in made.items()}
    assert not any(failed.values()), failed


def start_server(command: str, page: Page) -> None:
    """Start a server block's command on a free port; without `--compile` it serves eager, as
    `server_utils.braid_server` does (compiling the embedded model at start takes minutes)."""
    if "--compile" not in command:
        command += " --compile off"
    port = free_port()
    page_port = server_port(command)
    if "--port " in command:
        command = re.sub(r"--port \d+", f"--port {port}", command)
    else:
        command += f" --port {port}"
    log = open(page.sandbox / f"server-{page_port}.log", "w")  # noqa: SIM115 - the server's
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=page.sandbox,
                            env=environment(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    page.servers[page_port] = (proc, port)
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, f"{command} exited:\n{Path(log.name).read_text()}"
        assert time.monotonic() < deadline, f"{command} not healthy within 240 s"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)


def point_at_servers(code: str, page: Page) -> str:
    """Replace each `127.0.0.1:PORT` with the address of the server started for PORT."""
    def replace(match: re.Match) -> str:
        page_port = int(match[1])
        assert page_port in page.servers, \
            f"no server block before this one serves port {page_port}"
        return f"127.0.0.1:{page.servers[page_port][1]}"

    return _ADDRESS.sub(replace, code)


def run_block(block: Block, page: Page) -> None:
    code = point_at_servers(block.code, page)
    if block.lang == "python":
        script = page.sandbox / f"{Path(block.page).stem}_line_{block.line}.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", code]
    timeout = SLOW_TIMEOUT_S - 60 if block.slow else 540
    # A session of its own: whatever the block started is ended with it, even when it fails
    proc = subprocess.Popen(argv, cwd=page.sandbox, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        kill_session(proc.pid)
    report = f"{block.page} line {block.line}:\n{code}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    assert proc.returncode == 0, report
    assert stdout.strip(), report
    assert '"error"' not in stdout, report  # a server's error body (curl exits 0)


def _param(block: Block):
    marks = [pytest.mark.slow, pytest.mark.timeout(SLOW_TIMEOUT_S)] if block.slow else []
    return pytest.param(block, id=block.id, marks=marks)


def _last_of_its_page(request) -> bool:
    """Whether no block of this page runs after this one in this session."""
    mine = request.node.callspec.params["block"]
    later = request.session.items[request.session.items.index(request.node) + 1:]
    return not any(getattr(item, "callspec", None) is not None
                   and getattr(item.callspec.params.get("block"), "page", None) == mine.page
                   for item in later)


@pytest.mark.parametrize("block", [_param(b) for b in all_blocks()])
def test_doc_block(block: Block, pages, request):
    page = pages(block.page)
    failed = {}
    try:
        if block.mode == "skip":
            pytest.skip(block.reason)
        if "../shared/" in block.code and not SHARED.is_dir():
            pytest.skip(f"{SHARED} (the workspace's shared data) is not there")
        if block.mode == "server":
            for command in commands(block.code):
                start_server(command, page)
        else:
            run_block(block, page)
    finally:
        if _last_of_its_page(request):
            failed = page.stop_servers()
    assert not failed, f"{block.page}: servers that did not exit 0 on SIGTERM: {failed}"


def test_the_docs_have_fast_slow_server_and_skipped_blocks():
    blocks = all_blocks()
    assert {"fast", "slow", "server", "skip"} <= {b.mode for b in blocks}
    assert all(b.reason for b in blocks if b.mode == "skip")
    assert any(b.mode == "server" and not b.slow for b in blocks)  # `make test` serves


def test_every_server_address_has_a_server_block_before_it():
    """Checked without running anything: a client block of `make test` never waits on a
    server that only `make test-all` starts."""
    for page in PAGES:
        served: dict[int, bool] = {}  # port -> whether its server block is slow
        for block in page_blocks(page):
            if block.mode == "server":
                served.update({port: block.slow for port in server_ports(block.code)})
            elif block.mode != "skip":
                for port in map(int, _ADDRESS.findall(block.code)):
                    assert port in served, f"{block.id}: nothing serves port {port}"
                    assert block.slow or not served[port], \
                        f"{block.id} runs in make test, its server (port {port}) only in test-all"


def test_the_cli_reference_is_current():
    script = ROOT / "scripts" / "cli_reference.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=environment(), check=True)
    assert proc.stdout == (ROOT / "docs" / "cli.md").read_text(), \
        "docs/cli.md is not what the parser says: run `python scripts/cli_reference.py --out " \
        "docs/cli.md`"


def _anchors(text: str) -> set[str]:
    """The anchors GitHub makes of a page's headings, and its explicit `<a id=...>`s."""
    found, seen = set(re.findall(r'<a id="([^"]+)"', text)), {}
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M),
                              re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_link_lands():
    """Relative links point at files that exist, and at headings those pages have."""
    for page in PAGES:
        text = (ROOT / page).read_text()
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / page).parent / path if path else ROOT / page
            assert file.exists(), f"{page}: link to {target}: no such file"
            if anchor and file.suffix == ".md":
                assert anchor in _anchors(file.read_text()), \
                    f"{page}: link to {target}: no such heading"


def test_the_readme_links_every_page_and_every_result_has_its_table():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README is a front page: 250 lines at most"
    for page in PAGES[1:]:
        assert f"({page})" in readme or f"({page}#" in readme, f"README: no link to {page}"
    linked = "".join((ROOT / page).read_text() for page in PAGES)
    results = sorted((ROOT / "docs" / "results").glob("*.json"))
    assert results
    for result in results:
        assert json.loads(result.read_text())["rows"], f"{result.name} has no rows"
        assert f"results/{result.name}" in linked, f"no page shows {result.name}"
