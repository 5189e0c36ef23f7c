"""A driver process for tests that kill it: started from a script that prints its ranks' pids,
then SIGKILLed, after which its ranks must exit on their own (importable by test modules)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil


@contextmanager
def driver_process(script: str) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """Run `script` (which prints its rank pids on one line, then sleeps) in a new Python;
    yield the process and the pids. The driver is killed on the way out, whatever happened."""
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        yield driver, [int(pid) for pid in driver.stdout.readline().split()]
    finally:
        driver.kill()
        driver.wait()


def kill_and_wait_for_ranks(driver: subprocess.Popen, pids: list[int], within_s: float) -> None:
    """SIGKILL the driver; assert its ranks have exited (or are zombies) within `within_s`."""
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + within_s
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
              for pid in pids):
        assert time.monotonic() < deadline, "ranks outlived their killed driver"
        time.sleep(0.1)
