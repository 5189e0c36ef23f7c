"""Soak `braid serve --tp 2` across two emulated hosts (scripts/two_hosts.py) under
`bench-serving`, with glibc's heap checks on (`MALLOC_CHECK_=3`: a double free aborts the rank).

    python scripts/soak_two_hosts.py --runs 4 --rate 1gbit --rate 300mbit --concurrency 8 \
        --concurrency 32 --config "overlap+int8=--overlap on --comm-compression int8"

Each run starts a server (`--dtype fp32 --compile off` plus the configuration's flags), sends
`--num-prompts` random prompts at one of the concurrencies from inside host 0, then stops the
server with SIGTERM. A run is clean when every request completed, the server exited 0 and
neither host's log shows a crash (a signal, "double free", "corrupted", "invalid pointer"). It
prints a line per run and the counts per configuration, and exits 1 if any run was not clean.
Needs root (see two_hosts.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from two_hosts import TwoHosts  # noqa: E402

PORT = 30000  # inside host 0's namespace
START_TIMEOUT_S = 300
CRASH = re.compile(r"double free|corrupted|invalid pointer|Segmentation fault|SIGSEGV|SIGABRT"
                   r"|Fatal Python error|exited with code -|killed by")


def soak_run(hosts: TwoHosts, flags: list[str], concurrency: int, prompts: int,
             log_dir: Path) -> tuple[bool, str]:
    """One server run under load; (clean, what happened)."""
    url = f"http://{hosts.address(0)}:{PORT}"
    serve = ["serve", "--tp", "2", "--host", hosts.address(0), "--port", str(PORT),
             "--dtype", "fp32", "--compile", "off", "--log-level", "warning", *flags]
    logs = [open(log_dir / f"h{h}.log", "w") for h in (0, 1)]
    agents = [hosts.popen(h, hosts.torchrun_argv(h, serve), env={"MALLOC_CHECK_": "3"},
                          stdout=logs[h], stderr=subprocess.STDOUT) for h in (0, 1)]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with hosts.in_namespace(0):
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            if agents[0].poll() is not None or time.monotonic() > deadline:
                return False, "did not start"
            time.sleep(0.5)
        bench = hosts.popen(0, [sys.executable, "-m", "braid.cli", "bench-serving",
                                "--base-url", url, "--dataset-name", "random-ids",
                                "--num-prompts", str(prompts), "--random-input-len", "256",
                                "--random-output-len", "64", "--max-concurrency",
                                str(concurrency), "--disable-tqdm", "--output-file",
                                str(log_dir / "bench.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = bench.communicate(timeout=1200)[0]
        results = [json.loads(line) for line in
                   (log_dir / "bench.jsonl").read_text().splitlines()] if \
            (log_dir / "bench.jsonl").exists() else []
        completed = results[-1]["completed"] if results else 0
        # SIGTERM to the server (host 0's worker), as a service manager stops it: torchrun's
        # agent itself exits 1 on a signal, whatever its workers do
        for worker in psutil.Process(agents[0].pid).children():
            worker.send_signal(signal.SIGTERM)
        codes = [agent.wait(60) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
        for log in logs:
            log.close()
    crashed = [m.group(0) for h in (0, 1)
               if (m := CRASH.search((log_dir / f"h{h}.log").read_text()))]
    clean = completed == prompts and codes == [0, 0] and not crashed
    if not clean:  # keep the logs
        kept = Path(tempfile.mkdtemp(prefix="braid-soak-"))
        for log in log_dir.iterdir():
            kept.joinpath(log.name).write_bytes(log.read_bytes())
        detail = f"logs in {kept}; "
    else:
        detail = ""
    detail += f"{completed}/{prompts} requests, exit codes {codes}"
    if crashed:
        detail += f", crash: {crashed}"
    if not results:
        detail += f", bench: {output[-300:]}"
    return clean, detail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4, help="runs per configuration and rate")
    parser.add_argument("--rate", action="append", help="link rates (default 1gbit)")
    parser.add_argument("--concurrency", type=int, action="append",
                        help="bench-serving concurrencies, taken in turn (default 8, 32)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--config", action="append",
                        help="NAME=FLAGS of braid serve (default: the defaults)")
    args = parser.parse_args()
    configs = [c.split("=", 1) for c in args.config or ["defaults="]]
    concurrencies = itertools.cycle(args.concurrency or [8, 32])
    counts: dict[str, list[int]] = {}
    for rate in args.rate or ["1gbit"]:
        with TwoHosts(rate) as hosts:
            for (name, flags), run in itertools.product(configs, range(args.runs)):
                concurrency = next(concurrencies)
                with tempfile.TemporaryDirectory() as folder:
                    clean, detail = soak_run(hosts, flags.split(), concurrency,
                                             args.num_prompts, Path(folder))
                key = f"{name} at {rate}"
                counts.setdefault(key, [0, 0])[clean] += 1
                print(f"{key}, concurrency {concurrency}, run {run + 1}: "
                      f"{'clean' if clean else 'NOT CLEAN'} ({detail})", flush=True)
    for key, (bad, good) in counts.items():
        print(f"{key}: {good} clean of {good + bad} runs")
    return 0 if all(bad == 0 for bad, _ in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
