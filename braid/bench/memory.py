"""The memory a benchmark's processes take: the peak over a run of the summed proportional set
size (PSS: each page shared by n processes counted 1/n in each) of this process and every
process it started (the ranks), sampled by a thread from `/proc` (Linux)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

SAMPLE_S = 0.1
# A sample makes the kernel walk every page of every process's maps (smaps_rollup): tens of
# milliseconds for ranks holding gigabytes, taken from the cores the benchmark measures (at
# 0.1 s apart, a quarter of a core while a 1B model decoded). Waiting this many times a
# sample's cost before the next keeps that near 2% of one core.
WAIT_PER_COST = 50


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the task ended
            continue
    return children


def _pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:  # the process ended
        pass
    return 0


def summed_pss_bytes(root: int | None = None) -> int:
    """PSS of process `root` (this one) and of all its descendants, in bytes."""
    pending, total = [root or os.getpid()], 0
    while pending:
        pid = pending.pop()
        total += _pss_bytes(pid)
        pending += _children(pid)
    return total


class PeakMemory:
    """`with PeakMemory() as peak:` samples `summed_pss_bytes` until the block ends;
    `peak.bytes` is the largest sample (0 where /proc has no PSS)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)

    def _sample(self) -> None:
        while True:
            start = time.perf_counter()
            self.bytes = max(self.bytes, summed_pss_bytes())
            cost = time.perf_counter() - start
            if self._done.wait(max(SAMPLE_S, WAIT_PER_COST * cost)):
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
