"""Ranks spawned as processes on this host, and watched (`LocalRankGroup`).

The calling process is the driver: it holds the rendezvous store (on a free port), starts one
process per rank, talks to each over a pipe, and notices within a fraction of a second when a rank
raises or dies. Then it stops every other rank and raises `RankFailure` with that rank's error, so
a launch never hangs on a dead peer.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import NoReturn

from braid import spawn
from braid.distributed.ranks import PEER_FAILURE_MARKERS, RankFailure, Target
from braid.platform import usable_cores
from braid.spawn import end_process_group, lead_process_group

POLL_S = 0.05
STOP_WAIT_S = 1.0  # how long a closing group waits for its ranks before each harder signal
# Settings read at start-up by a rank process's libraries, where the user has not set them:
# - glibc malloc keeps freed memory instead of returning large blocks to the OS, so each step's
#   activations reuse warm pages rather than page-faulting fresh ones (a prefill's MLP spent
#   more time in page faults than in its elementwise work without this);
# - libgomp's idle threads spin for longer (a fraction of a second, against its default of a
#   few ms) before they sleep: a compiled decode step of one sequence runs many parallel GEMVs
#   with serial gaps between them, and waking sleeping threads for them cost a large share of
#   the step (docs/kernel-choices.md, "Compiled steps"). An idle engine's threads still sleep.
RANK_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
            "GOMP_SPINCOUNT": "10000000"}
def describe_exit(exitcode: int) -> str:
    """`killed by SIGKILL`, `exited with code 1`, ... for a process's exit code."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def cores_for_rank(rank: int, world_size: int, cores: list[int]) -> list[int]:
    """This rank's own cores: an equal share, at least one (shared round-robin if too few)."""
    per_rank = max(1, len(cores) // world_size)
    start = (rank * per_rank) % len(cores)
    return [cores[(start + i) % len(cores)] for i in range(per_rank)]


def exit_with_parent(poll_s: float = 0.2, parent: int | None = None,
                     on_exit: Callable[[], object] | None = None) -> None:
    """End this process soon after the process that started it (`parent`: its pid, known to
    the caller; else this process's parent now) dies, even by SIGKILL, first running
    `on_exit`: the cleanup the dead process could not run.

    A watcher thread, not Linux's parent-death signal: that signal fires when the *thread*
    that started the child exits, so ranks launched from a short-lived thread (a server's
    worker, a test helper) would die with it. A spawned rank passes its driver's pid: the
    driver may die while the rank is still importing, before this runs.
    """
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        exit_after(on_exit, 1)

    threading.Thread(target=watch, name="braid-parent-watch", daemon=True).start()


def _rank_entry(target: Target, rank: int, world_size: int, store_port: int,
                cores: list[int], conn: Connection, args: tuple, driver: int,
                cleanup: Callable[[], str | None] | None) -> None:
    lead_process_group()
    exit_with_parent(parent=driver, on_exit=cleanup)
    # The driver decides when ranks stop: SIGINT is ignored, and SIGTERM keeps its default
    # action, which ends a rank at once even inside a collective (where a Python handler would
    # wait for it); the driver then runs the cleanup and ends the rank's process group (its
    # compilers).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import torch
        import torch.distributed as dist
        from tqdm import tqdm

        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        # tqdm's default lock is a named semaphore, made by the first progress bar (inductor's
        # while it compiles, transformers' while it loads); the rank's os._exit skips the
        # finalizer that releases it, and the resource tracker warned of a leak at every
        # shutdown. A rank's bars are written by its own threads only.
        tqdm.set_lock(threading.RLock())
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        spawn.resolve(target)(rank, world_size, conn, *args)
    except BaseException:  # noqa: BLE001 - every failure must reach the driver
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            exit_after(cleanup, 1)
    exit_after(cleanup, 0)


def exit_after(cleanup: Callable[[], object] | None, code: int) -> NoReturn:
    """`os._exit(code)` once `cleanup` (if any) has run and the processes this one started
    in its own process group (compilers) are killed. A rank runs its launch's cleanup on every
    way out, as the driver does when it closes the group: the driver may be dead (its pipe's
    end is then what stops the rank, often before the parent watcher notices)."""
    try:
        if cleanup is not None:
            cleanup()
    finally:
        try:
            if os.getpgrp() == os.getpid():
                end_process_group(os.getpid())
        finally:
            os._exit(code)


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables not already set by the user, for processes started inside."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


class LocalRankGroup:
    """`world_size` rank processes on this host running `target` (see `braid.distributed.ranks`).

    `cleanup` runs when the group closes, on every path (shared-memory segments use it); the
    line it returns ends a failure report. Each rank runs it too as it exits, so it must be
    picklable and harmless to run more than once: a driver killed without closing the group
    (SIGKILL, or SIGTERM, whose default action skips `atexit`) while its ranks were still
    starting would otherwise leave their shared-memory segment, not yet mapped and unlinked.
    """

    def __init__(self, world_size: int, target: Target, args: tuple = (),
                 cleanup: Callable[[], str | None] | None = None) -> None:
        import torch.distributed as dist

        cores = usable_cores()
        if world_size > len(cores):
            warnings.warn(f"--tp {world_size} exceeds the {len(cores)} usable cores: ranks share "
                          "cores and run slower", stacklevel=2)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[mp.Process] = []
        self._closed = False
        self._cleanup = cleanup
        self._cleanup_report: str | None = None
        # When each rank failed (reported an error or exited; monotonic time): failures are
        # reported in that order, so the rank that failed first is named before those it
        # brought down.
        self._failure_times: dict[int, float] = {}
        self._stop_time: float | None = None  # when close() began stopping ranks
        self._answered: set[int] = set()  # ranks that have sent anything (they started)
        self._answer_pending = False  # a wait for an answer was interrupted: ranks are busy
        atexit.register(self.close)
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_entry, daemon=True, name=f"braid-rank-{rank}",
                args=(target, rank, world_size, self._store.port,
                      cores_for_rank(rank, world_size, cores), child, args, os.getpid(),
                      cleanup))
            with _environment(RANK_ENV):  # read by the child's libraries at start-up
                proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        threading.Thread(target=self._watch_exits, name="braid-rank-watch", daemon=True).start()

    def _watch_exits(self) -> None:
        waiting = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        while waiting:
            for sentinel in mp.connection.wait(list(waiting)):
                self._failure_times.setdefault(waiting.pop(sentinel), time.monotonic())

    @property
    def world_size(self) -> int:
        return len(self.procs)

    def send_all(self, message: object) -> None:
        """Send the same message to every rank, pickled once (`Connection.send` pickles per
        call: a step plan reached rank 1 that much later, and rank 0 waited for it at the
        step's first collective)."""
        payload = ForkingPickler.dumps(message)
        for conn in self.conns:
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._fail()

    def send(self, rank: int, message: object) -> None:
        """Send a message to one rank (rank 0's grammar masks: only it samples)."""
        try:
            self.conns[rank].send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._fail()

    def recv(self, rank: int = 0, timeout: float | None = None) -> object:
        """Wait for `rank`'s answer while watching every rank; raise `RankFailure` on a death."""
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = self.conns[rank]
        self._answer_pending = True  # until it answers: still so if this wait is interrupted
        while not conn.poll(POLL_S):
            if any(p.exitcode is not None for p in self.procs):
                self._fail()
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise RankFailure(f"rank {rank} did not answer within {timeout:.0f} s")
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            self._fail()
        if kind == "error":
            self._failure_times.setdefault(rank, time.monotonic())
            self._fail({rank: value})
        self._answered.add(rank)
        self._answer_pending = False
        return value

    def check_alive(self) -> None:
        """Raise `RankFailure` if a rank has died (for a driver that is not waiting on one)."""
        if any(p.exitcode is not None for p in self.procs):
            self._fail()

    def gather(self, timeout: float | None = None) -> list[object]:
        """One answer from every rank, in rank order."""
        return [self.recv(rank, timeout) for rank in range(self.world_size)]

    def request(self, message: object) -> object:
        """Send to every rank and return rank 0's answer."""
        self.send_all(message)
        return self.recv(0)

    def _fail(self, reported: dict[int, str] | None = None) -> NoReturn:
        """Stop all ranks and raise with every rank's error, the one that failed first first.

        When one rank fails its peers soon fail too, inside a collective; their errors (a reset
        connection) follow the error that caused them, and the ranks the launcher stopped
        come last.
        """
        reported = dict(reported or {})
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for rank, conn in enumerate(self.conns):
                try:
                    while rank not in reported and conn.poll(0):
                        kind, value = conn.recv()
                        if kind == "error":
                            self._failure_times.setdefault(rank, time.monotonic())
                            reported[rank] = value
                except (EOFError, OSError):
                    pass
            if all(r in reported or p.exitcode is not None for r, p in enumerate(self.procs)):
                break
            time.sleep(POLL_S)
        self.close()
        raise RankFailure(self._failure_report(reported))

    def _failure_report(self, reported: dict[int, str]) -> str:
        failed, stopped = [], []
        for rank, proc in enumerate(self.procs):
            failed_at = self._failure_times.get(rank, float("inf"))
            if rank not in reported and failed_at >= (self._stop_time or float("inf")):
                stopped.append(f"rank {rank} was stopped by the launcher "
                               f"({describe_exit(proc.exitcode or 0)})")
            elif rank in reported:
                secondary = any(m in reported[rank] for m in PEER_FAILURE_MARKERS)
                failed.append(((secondary, failed_at), f"rank {rank} failed:\n{reported[rank]}"))
            elif proc.exitcode not in (None, 0):
                how = describe_exit(proc.exitcode)
                if rank not in self._answered:  # e.g. its import of the main module failed
                    how = f"while starting, {how}; its own error, if any, is printed above"
                failed.append(((False, failed_at), f"rank {rank} died ({how})"))
        failed.sort(key=lambda f: f[0])
        lines = [text for _, text in failed] or ["a rank exited unexpectedly"]
        lines += stopped
        if self._cleanup_report:
            lines.append(self._cleanup_report)
        return "\n".join(lines)

    def close(self) -> None:
        """Stop every rank: ask politely, then terminate, then kill (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for rank, proc in enumerate(self.procs):  # dead, whether or not the watcher saw it yet
            if proc.exitcode is not None:
                self._failure_times.setdefault(rank, time.monotonic())
        self._stop_time = time.monotonic()
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
        # An idle rank reads "stop" at once; one in the middle of a step or a compile (the
        # driver was interrupted waiting for it) would read it only when done: SIGTERM.
        deadline = time.monotonic() + (0.0 if self._answer_pending else STOP_WAIT_S)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(STOP_WAIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
            end_process_group(proc.pid)  # what a killed rank left running
        for conn in self.conns:
            conn.close()
        if self._cleanup is not None:
            self._cleanup_report = self._cleanup()
        atexit.unregister(self.close)


