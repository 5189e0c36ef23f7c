"""`braid bench-comm`: latency and bandwidth of the collectives, per backend, side by side.

Each size is measured after warm-up as back-to-back synchronous collectives on every rank;
rank 0's per-operation times give the median and p90. Algorithm bandwidth is bytes / median
time, where bytes is the tensor reduced (all-reduce) or the gathered output (all-gather, each
rank contributing bytes / tp), as nccl-tests count it.

`block_sum` is what a decoder block pays for its all-reduce: the new residual, the sum over
ranks plus the old residual (`wait_sum` with a residual). Through shm that is the copy into
the slot, the wait and one summing pass into the residual; through torch an all-reduce, then
the add. The tensors are rows of `BLOCK_ROW` elements.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import numpy as np
import torch

from braid import native
from braid.config import DTYPES, ParallelConfig, resolve_dtype
from braid.distributed.comm import Communicator, TorchCommunicator
from braid.distributed.ranks.local import LocalRankGroup
from braid.distributed.shm import ShmCommunicator, ShmSegment
from braid.errors import UserError
from braid.layers.fused import configure_compile
from braid.platform import usable_cores

OPS = ("all_reduce", "block_sum", "all_gather")
BLOCK_ROW = 1024  # elements of a token's hidden state in the block sums
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_sizes(text: str) -> list[int]:
    """'4K,64K,1M' -> byte counts (binary units)."""
    sizes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", item.upper())
        if not match or int(match.group(1)) == 0:
            raise UserError(f"--sizes: cannot read {item!r}; use e.g. 4K,64K,1M,16M")
        sizes.append(int(match.group(1)) * _UNITS[match.group(2)])
    return sizes


def _iterations(nbytes: int) -> int:
    return int(np.clip(200 * (1 << 16) / max(nbytes, 1 << 16), 20, 200))


def _measure(comm: Communicator, op: str, nbytes: int, dtype: torch.dtype) -> list[float]:
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(1, nbytes // elem)
    if op == "all_gather":
        numel = max(1, numel // comm.world_size)
    x = torch.randn(numel).to(dtype)
    if op == "block_sum" and numel % BLOCK_ROW == 0:
        x = x.view(-1, BLOCK_ROW)  # rows of tokens, which decide whether the sum is compiled
    run = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather,
           "block_sum": lambda y: _block_sum(comm, y, x)}[op]
    for _ in range(5):
        run(x.clone())
    times = []
    for _ in range(_iterations(nbytes)):
        y = x.clone()  # all-reduce may work in place; every iteration reduces fresh data
        start = time.perf_counter()
        run(y)
        times.append(time.perf_counter() - start)
    return times


def _block_sum(comm: Communicator, partial: torch.Tensor,
               residual: torch.Tensor) -> torch.Tensor:
    """The residual plus the sum over ranks of `partial`."""
    return comm.wait_sum(comm.all_reduce_async(partial), residual)


def bench_comm_worker(rank: int, world_size: int, conn, backends: list[str], sizes: list[int],
                      dtype: str, segment: ShmSegment | None) -> None:
    """Rank entry point: measure every backend, op and size; rank 0 answers the rows."""
    configure_compile("auto", native.load())  # as a rank configures it
    rows = []
    for backend in backends:
        comm = (ShmCommunicator(rank, segment, ParallelConfig().comm_timeout_s)
                if backend == "shm"
                else TorchCommunicator(rank, world_size))
        for op in OPS:
            for nbytes in sizes:
                times = np.array(_measure(comm, op, nbytes, DTYPES[dtype])) * 1e6
                median, p90 = float(np.median(times)), float(np.percentile(times, 90))
                rows.append({"backend": backend, "op": op, "dtype": dtype, "tp": world_size,
                             "bytes": nbytes, "median_us": median, "p90_us": p90,
                             "algbw_gbps": nbytes / median / 1e3})
        if backend == "shm":
            comm.close()
    conn.send(("ok", rows))
    conn.recv()


def _size_label(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


def print_table(rows: list[dict], backends: list[str]) -> None:
    """One table per collective: a line per size, the backends side by side."""
    for op in OPS:
        print(f"\n{op}  dtype={rows[0]['dtype']}  tp={rows[0]['tp']}  "
              f"cores={len(usable_cores())}")
        header = f"{'size':>6}"
        for backend in backends:
            header += f" | {backend + ' median us':>16} {'p90 us':>9} {'GB/s':>7}"
        if len(backends) == 2:
            header += f" | {backends[1] + '/' + backends[0]:>11}"
        print(header)
        for nbytes in sorted({r["bytes"] for r in rows}):
            cells = {r["backend"]: r for r in rows if r["op"] == op and r["bytes"] == nbytes}
            line = f"{_size_label(nbytes):>6}"
            for backend in backends:
                r = cells[backend]
                line += f" | {r['median_us']:16.1f} {r['p90_us']:9.1f} {r['algbw_gbps']:7.2f}"
            if len(backends) == 2:
                ratio = cells[backends[1]]["median_us"] / cells[backends[0]]["median_us"]
                line += f" | {ratio:10.1f}x"
            print(line)


def run_bench_comm(args: argparse.Namespace) -> list[dict]:
    """Run the benchmark as the CLI flags say; print the table; append JSONL rows."""
    if args.tp < 2:
        raise UserError("bench-comm needs --tp 2 or more")
    backends = ["shm", "torch"] if args.backend == "both" else [args.backend]
    sizes = parse_sizes(args.sizes)
    dtype = resolve_dtype(args.dtype)
    segment = ShmSegment.create(args.tp) if "shm" in backends else None
    group = LocalRankGroup(args.tp, bench_comm_worker, (backends, sizes, dtype, segment),
                      cleanup=segment.unlink if segment else None)
    try:
        rows = group.recv(0)
    finally:
        group.close()
    print_table(rows, backends)
    if args.result_file:
        with open(args.result_file, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return rows
