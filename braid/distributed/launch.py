"""Start tensor-parallel ranks as processes on this host and watch them.

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
import sys
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

from braid.config import UserError, usable_cores

POLL_S = 0.05
# Settings read at start-up by a rank process's libraries, where the user has not set them:
# - glibc malloc keeps freed memory instead of returning large blocks to the OS, so each step's
#   activations reuse warm pages rather than page-faulting fresh ones (a prefill's MLP spent
#   more time in page faults than in its elementwise work without this);
# - libgomp's idle threads spin for longer (about 0.25 s on a 2-core Zen 5, against its default
#   of a few ms) before they sleep: a compiled decode step of one sequence runs ~120 parallel
#   GEMVs with serial gaps between them, and waking sleeping threads for them cost a quarter of
#   the step (`bench-one-batch --compile on`, bs 1: 1.15-1.32x decode with this; Hugging Face
#   in the same rank process 0.99x). An idle engine's threads still go to sleep.
RANK_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
            "GOMP_SPINCOUNT": "10000000"}
# Errors a rank gets when a peer died under it, as opposed to the peer's own error.
_PEER_FAILURE_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


class RankFailure(RuntimeError):
    """A rank raised or died; the message carries that rank's error."""


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
        _exit_after(on_exit, 1)

    threading.Thread(target=watch, name="braid-parent-watch", daemon=True).start()


def _rank_entry(target: Callable, rank: int, world_size: int, store_port: int,
                cores: list[int], conn: Connection, args: tuple, driver: int,
                cleanup: Callable[[], str | None] | None) -> None:
    exit_with_parent(parent=driver, on_exit=cleanup)
    # Ctrl-C reaches the whole process group: the driver decides when ranks stop.
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
        target(rank, world_size, conn, *args)
    except BaseException:  # noqa: BLE001 - every failure must reach the driver
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            _exit_after(cleanup, 1)
    _exit_after(cleanup, 0)


def _exit_after(cleanup: Callable[[], object] | None, code: int) -> NoReturn:
    """`os._exit(code)` once `cleanup` (if any) has run. A rank runs its launch's cleanup on
    every way out, as the driver does when it closes the group: the driver may be dead (its
    pipe's end is then what stops the rank, often before the parent watcher notices)."""
    try:
        if cleanup is not None:
            cleanup()
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


class RankGroup:
    """`world_size` rank processes running `target(rank, world_size, conn, *args)`.

    `target` receives messages with `conn.recv()` and answers with `conn.send(("ok", value))`;
    `torch.distributed` is initialised before it runs. Exceptions are reported automatically.
    `cleanup` runs when the group closes, on every path (shared-memory segments use it); the
    line it returns ends a failure report. Each rank runs it too as it exits, so it must be
    picklable and harmless to run more than once: a driver killed without closing the group
    (SIGKILL, or SIGTERM, whose default action skips `atexit`) while its ranks were still
    starting would otherwise leave their shared-memory segment, not yet mapped and unlinked.
    """

    def __init__(self, world_size: int, target: Callable, args: tuple = (),
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
                secondary = any(m in reported[rank] for m in _PEER_FAILURE_MARKERS)
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
        deadline = time.monotonic() + 2.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        if self._cleanup is not None:
            self._cleanup_report = self._cleanup()
        atexit.unregister(self.close)


# --- Ranks started by torchrun ---------------------------------------------------------------
# torchrun starts every rank itself (possibly on several hosts) and tears the job down when any
# of them fails on its host; across hosts nothing tells one host's ranks that the other's are
# gone. Rank 0 is the driver: its own rank runs in a thread beside it, and step plans reach the
# other ranks by broadcast over a separate gloo group (so they never interleave with the model's
# collectives on the default group). A heartbeat through torchrun's store (`_Heartbeat`) ends
# the launch on both sides within its timeout when a host is killed or cut off.

HEARTBEAT_S = 1.0
# The plans' group waits as long as a server may idle between steps (the heartbeat, not this,
# notices a lost host). A year: gloo adds it to a nanosecond clock.
_IDLE_TIMEOUT = timedelta(days=365)


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def ranks_span_hosts() -> bool:
    """Whether this launch's ranks run on more than one host (torchrun with several nodes)."""
    launched = torchrun_rank()
    return (launched is not None
            and int(os.environ.get("LOCAL_WORLD_SIZE", launched[1])) < launched[1])


def _init_torchrun_process() -> object:
    """Pin this rank's cores, join the default group (env://); the plans' group."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cores = cores_for_rank(local_rank, local_world, usable_cores())
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")
    return dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)


class _Heartbeat:
    """Every HEARTBEAT_S seconds this rank bumps its counter in torchrun's store and reads the
    other ranks' counters, in a daemon thread over a store connection of its own; `on_loss`
    gets the reason once another rank's counter has not moved for `timeout_s`, or the store
    (on host 0) cannot be reached. Not a collective: gloo collectives from a second thread
    crashed the first thread's (heap corruption within minutes, with or without compression).
    """

    def __init__(self, timeout_s: float, on_loss: Callable[[str], None]) -> None:
        self._timeout_s, self._on_loss = timeout_s, on_loss
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="braid-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        import torch.distributed as dist

        rank, world_size = torchrun_rank()
        prefix = f"braid-heartbeat/{os.environ['TORCHELASTIC_RUN_ID']}"
        others = [r for r in range(world_size) if r != rank]
        keys = [f"{prefix}/{r}" for r in others]
        last = {r: (None, time.monotonic()) for r in others}  # counter, when it last moved
        beats = 0
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False,
                                  timeout=timedelta(seconds=self._timeout_s))
            while not self._stopping.is_set():
                store.set(f"{prefix}/{rank}", str(beats))
                beats += 1
                seen = store.multi_get(keys) if store.check(keys) else [None] * len(keys)
                now = time.monotonic()
                for r, value in zip(others, seen):
                    if value != last[r][0]:
                        last[r] = (value, now)
                    elif now - last[r][1] > self._timeout_s:
                        self._on_loss(f"rank {r} has not beaten for {self._timeout_s:g} s")
                        return
                self._stopping.wait(HEARTBEAT_S)
        except Exception as e:  # noqa: BLE001 - the store's host is gone or cut off
            if not self._stopping.is_set():
                text = str(e).strip()
                self._on_loss(f"torchrun's store on rank 0's host stopped answering: "
                              f"{text.splitlines()[0] if text else repr(e)}")

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(HEARTBEAT_S + 5)


def _lost_ranks(timeout_s: float, reason: str) -> str:
    rank, world_size = torchrun_rank()
    others = ", ".join(str(r) for r in range(world_size) if r != rank)
    return (f"lost contact with rank {others}: its host died, its ranks were killed, or the link "
            f"is down (the heartbeat waits --comm-timeout, {timeout_s:g} s): {reason}")


class _BroadcastConn:
    """The pipe end a non-zero torchrun rank reads: messages come by broadcast from rank 0;
    what it sends is dropped (only rank 0 answers the driver)."""

    def __init__(self, group: object) -> None:
        self.group = group

    def recv(self) -> object:
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def send(self, message: object) -> None:
        pass


def run_torchrun_worker(target: Callable) -> None:
    """Body of a non-zero torchrun rank: take the target's arguments from rank 0, then serve
    rank 0's broadcasts until told to stop; exit 1 with a message if rank 0 is lost."""
    rank, world_size = torchrun_rank()
    conn = _BroadcastConn(_init_torchrun_process())
    args, timeout_s = conn.recv()

    def lost(reason: str) -> None:
        print(f"error: rank {rank}: {_lost_ranks(timeout_s, reason)}", file=sys.stderr,
              flush=True)
        os._exit(1)

    heartbeat = _Heartbeat(timeout_s, lost)
    try:
        target(rank, world_size, conn, *args)
    finally:
        heartbeat.stop()


class TorchrunGroup:
    """`RankGroup`'s interface on rank 0 of a torchrun launch (see the note above).
    `timeout_s`: how long a lost host goes unnoticed at most."""

    def __init__(self, world_size: int, target: Callable, args: tuple = (),
                 cleanup: Callable[[], str | None] | None = None,
                 timeout_s: float = 60.0) -> None:
        rank, launched = torchrun_rank()
        if rank != 0:
            raise RuntimeError("only torchrun's rank 0 drives; others run run_torchrun_worker")
        if world_size != launched:
            raise UserError(f"--tp {world_size} but torchrun started {launched} processes")
        self._cleanup = cleanup
        self._control = _init_torchrun_process()
        self._broadcast((args, timeout_s))  # the other ranks build the same engine from these
        self._lost: str | None = None

        def lost(reason: str) -> None:
            self._lost = _lost_ranks(timeout_s, reason)

        self._timeout_s = timeout_s
        self._heartbeat = _Heartbeat(timeout_s, lost)
        self._conn, child = mp.Pipe()
        self._closed = False

        def run_rank0() -> None:
            try:
                target(0, world_size, child, *args)
            except BaseException:  # noqa: BLE001 - reported to the driver thread
                error = traceback.format_exc()
                print(f"rank 0 failed:\n{error}", file=sys.stderr, flush=True)
                child.send(("error", error))

        self._thread = threading.Thread(target=run_rank0, name="braid-rank-0", daemon=True)
        self._thread.start()

    def _broadcast(self, message: object) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self._control)

    def send_all(self, message: object) -> None:
        self.check_alive()
        self._broadcast(message)
        self._conn.send(message)

    def send(self, rank: int, message: object) -> None:
        assert rank == 0, "only rank 0 is driven in this process"
        self._conn.send(message)

    def recv(self, rank: int = 0, timeout: float | None = None) -> object:
        while not self._conn.poll(POLL_S):
            self.check_alive()
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise RankFailure("rank 0 stopped without a word (its thread ended)") from None
        if kind == "error":
            raise self._rank0_failure(value)
        return value

    def _rank0_failure(self, error: str) -> RankFailure:
        """What rank 0's thread reported, as the driver raises it: the heartbeat's lost host
        where it noticed one, a peer that vanished mid-step by name, else the error itself."""
        if self._lost is not None:
            self._closed = True  # nothing to stop over a lost link: the process ends
            return RankFailure(self._lost)
        if any(m in error for m in _PEER_FAILURE_MARKERS):
            return RankFailure(_lost_ranks(self._timeout_s, error.strip().splitlines()[-1]))
        return RankFailure(f"rank 0 failed:\n{error}")

    def check_alive(self) -> None:
        if self._lost is not None:
            raise self._rank0_failure("")
        if not self._thread.is_alive():
            if self._conn.poll(0):  # it reported why just before it ended
                kind, value = self._conn.recv()
                if kind == "error":
                    raise self._rank0_failure(value)
            raise RankFailure("rank 0 stopped unexpectedly")

    def gather(self, timeout: float | None = None) -> list[object]:
        """Rank 0's answer (other ranks report to torchrun, which stops the job on failure)."""
        return [self.recv(0, timeout)]

    def request(self, message: object) -> object:
        self.send_all(message)
        return self.recv(0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._heartbeat.stop()
                self.send_all(("stop", None))
                self._thread.join()
            except (RankFailure, RuntimeError, OSError):
                pass  # the other hosts stopped first (torchrun ends every host at once)
        if self._cleanup is not None:
            self._cleanup()
            self._cleanup = None


def check_not_bootstrapping() -> None:
    """Refuse to start ranks from a spawned process that is still importing its parent's
    main module: the script created an engine at import time, without the main guard."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise UserError(
            "an engine was created while a braid rank process was starting: ranks are spawned, "
            "which imports your script again, so the code that creates the engine (LLM(...)) "
            "must not run at import time. Put it under `if __name__ == \"__main__\":` "
            "(see the README's Python API example)")


def launch_ranks(world_size: int, target: Callable, args: tuple = (),
                 cleanup: Callable[[], str | None] | None = None,
                 timeout_s: float = 60.0) -> RankGroup | TorchrunGroup:
    """Adopt torchrun's ranks when it started this process (a lost host is noticed within
    `timeout_s`), else spawn ranks on this host."""
    check_not_bootstrapping()
    if torchrun_rank() is not None:
        return TorchrunGroup(world_size, target, args, cleanup, timeout_s)
    return RankGroup(world_size, target, args, cleanup)
