"""Speculation against plain decoding, request by request: a fresh `braid serve` without
speculation, then a fresh one with it (never both at once; `--speculative-first` turns the
order round, so that runs in both orders can cancel what comes of being second), each driven
by the same `bench-serving` run with no warm-up request; prints each request's decode-rate
ratio, their median and least, and how many texts are identical (as `bench-serving
--baseline-file` does).

    python scripts/speculation_ab.py --tp 2 --dtype fp32 [--speculative ngram] \\
        [--speculative draft --draft-model PATH] [--server-flags "--model PATH"] \\
        [--dataset-name copy-edit-mmlu --dataset-path ../shared/data/mmlu] [--temperature 1]

Defaults: copy-edit-mmlu from ../shared/data/mmlu, 6 prompts of 1024 tokens asking for 512, at
concurrency 1, greedy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from braid.bench.datasets import Dataset
from braid.bench.serving import ServingConfig, compare_to_baseline, run_bench_serving

BRAID = str(Path(sys.executable).with_name("braid"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(flags: list[str], port: int) -> subprocess.Popen:
    """A braid server on 127.0.0.1:port, once it answers /health (start-up compiles)."""
    server = subprocess.Popen([BRAID, "serve", "--host", "127.0.0.1", "--port", str(port),
                               *flags], start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"braid serve {' '.join(flags)} exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(server)
    raise SystemExit("the server did not start within 15 minutes")


def stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--speculative", default="ngram")
    parser.add_argument("--draft-model", help="--speculative draft's model")
    parser.add_argument("--server-flags", default="", help="more flags for both servers")
    parser.add_argument("--dataset-name", default="copy-edit-mmlu")
    parser.add_argument("--dataset-path", default="../shared/data/mmlu")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--max-concurrency", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampled requests (default: greedy)")
    parser.add_argument("--speculative-first", action="store_true",
                        help="start the speculative server first, the plain one second")
    parser.add_argument("--output-file", help="append both runs' JSON lines here")
    args = parser.parse_args()

    common = ["--tp", str(args.tp), "--dtype", args.dtype, *args.server_flags.split()]
    dataset = Dataset(args.dataset_name, dataset_path=args.dataset_path,
                      num_prompts=args.num_prompts, random_input_len=args.input_len,
                      random_output_len=args.output_len, random_range_ratio=1.0)
    body = None if args.temperature is None else json.dumps({"temperature": args.temperature})
    speculative = ["--speculative", args.speculative]
    if args.draft_model:
        speculative += ["--draft-model", args.draft_model]
    runs = [("plain", []), (args.speculative, speculative)]
    rows = {}
    for tag, flags in runs[::-1] if args.speculative_first else runs:
        port = free_port()
        server = serve(common + flags, port)
        try:
            config = ServingConfig(base_url=f"http://127.0.0.1:{port}", dataset=dataset,
                                   max_concurrency=args.max_concurrency,
                                   warmup_requests=0, disable_tqdm=True,
                                   extra_request_body=body, output_details=True, tag=tag)
            rows[tag] = run_bench_serving(config)
        finally:
            stop(server)
    rows[args.speculative].update(compare_to_baseline(rows[args.speculative], rows["plain"]))
    if args.output_file:
        with open(args.output_file, "a") as f:
            for tag, _ in runs:
                f.write(json.dumps(rows[tag]) + "\n")


if __name__ == "__main__":
    main()
