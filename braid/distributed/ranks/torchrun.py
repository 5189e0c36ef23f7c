"""Ranks started by torchrun, possibly on several hosts (`TorchrunRankGroup`).

torchrun starts every rank itself and tears the job down when any of them fails on its host;
across hosts nothing tells one host's ranks that the other's are gone. Rank 0 is the driver:
its own rank runs in a thread beside it, and step plans reach the other ranks by broadcast over
a separate gloo group (so they never interleave with the model's collectives on the default
group). A heartbeat through torchrun's store (`_Heartbeat`) ends the launch on both sides within
its timeout when a host is killed or cut off, and carries rank 0's "stop" to ranks too busy
(compiling) to read the broadcast.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

from braid import spawn
from braid.distributed.ranks import PEER_FAILURE_MARKERS, RankFailure, Target
from braid.distributed.ranks.local import POLL_S, STOP_WAIT_S, cores_for_rank, exit_after
from braid.errors import UserError
from braid.platform import usable_cores

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
    corrupted the heap (within minutes: most likely docs/gloo-race.md's race), and the store
    needs none.

    The store also carries the launch's end: rank 0's `stop(announce=True)` sets a key that
    the other ranks' heartbeats read within a beat and answer with `on_stop`. A rank busy in a
    step or a compile would read the plans' "stop" only when done (minutes, compiling).
    """

    def __init__(self, timeout_s: float, on_loss: Callable[[str], None],
                 on_stop: Callable[[], None] | None = None) -> None:
        self._timeout_s, self._on_loss, self._on_stop = timeout_s, on_loss, on_stop
        self._stopping = threading.Event()
        self._announce = False
        self._thread = threading.Thread(target=self._beat, name="braid-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        import torch.distributed as dist

        rank, world_size = torchrun_rank()
        # A restarted launch (torchrun --max-restarts) keeps its run id, not its keys
        prefix = (f"braid-heartbeat/{os.environ['TORCHELASTIC_RUN_ID']}/"
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        others = [r for r in range(world_size) if r != rank]
        keys = [f"{prefix}/{r}" for r in others]
        stop_key = f"{prefix}/stop"
        last = {r: (None, time.monotonic()) for r in others}  # counter, when it last moved
        beats = 0
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False,
                                  timeout=timedelta(seconds=self._timeout_s))
            while not self._stopping.is_set():
                store.set(f"{prefix}/{rank}", str(beats))
                beats += 1
                if self._on_stop is not None and store.check([stop_key]):
                    self._on_stop()
                    return
                seen = store.multi_get(keys) if store.check(keys) else [None] * len(keys)
                now = time.monotonic()
                for r, value in zip(others, seen):
                    if value != last[r][0]:
                        last[r] = (value, now)
                    elif now - last[r][1] > self._timeout_s:
                        self._on_loss(f"rank {r} has not beaten for {self._timeout_s:g} s")
                        return
                self._stopping.wait(HEARTBEAT_S)
            if self._announce:
                store.set(stop_key, "")
        except Exception as e:  # noqa: BLE001 - the store's host is gone or cut off
            if not self._stopping.is_set():
                text = str(e).strip()
                self._on_loss(f"torchrun's store on rank 0's host stopped answering: "
                              f"{text.splitlines()[0] if text else repr(e)}")

    def stop(self, announce: bool = False) -> None:
        """Stop beating; with `announce`, tell the other ranks that the launch stops."""
        self._announce = announce
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


def run_torchrun_worker(target: Target) -> None:
    """Body of a non-zero torchrun rank: take the target's arguments from rank 0, then serve
    rank 0's broadcasts until told to stop; exit 1 with a message if rank 0 is lost."""
    rank, world_size = torchrun_rank()
    conn = _BroadcastConn(_init_torchrun_process())
    args, timeout_s = conn.recv()

    def lost(reason: str) -> None:
        print(f"error: rank {rank}: {_lost_ranks(timeout_s, reason)}", file=sys.stderr,
              flush=True)
        os._exit(1)

    # torchrun made this process a session's leader: what it started (compilers) ends with it
    heartbeat = _Heartbeat(timeout_s, lost, on_stop=lambda: exit_after(None, 0))
    try:
        spawn.resolve(target)(rank, world_size, conn, *args)
    finally:
        heartbeat.stop()


class TorchrunRankGroup:
    """`RankGroup` on rank 0 of a torchrun launch (see the module docstring).
    `timeout_s`: how long a lost host goes unnoticed at most."""

    def __init__(self, world_size: int, target: Target, args: tuple,
                 cleanup: Callable[[], str | None] | None, timeout_s: float) -> None:
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
                spawn.resolve(target)(0, world_size, child, *args)
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
        if any(m in error for m in PEER_FAILURE_MARKERS):
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
        """Stop every rank: idle ones read "stop" from the plans' broadcast, busy ones (in a
        step or a compile) hear it from the heartbeat within a beat. The heartbeat first: the
        broadcast may wait for a busy rank (this process is then killed by its parent)."""
        if not self._closed:
            self._closed = True
            self._heartbeat.stop(announce=True)
            try:
                self.send_all(("stop", None))
                self._thread.join(STOP_WAIT_S)  # a busy rank 0 ends with this process
            except (RankFailure, RuntimeError, OSError):
                pass  # the other hosts stopped first (torchrun ends every host at once)
        if self._cleanup is not None:
            self._cleanup()
            self._cleanup = None
