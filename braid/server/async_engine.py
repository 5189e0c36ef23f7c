"""The API process's handle on the engine process.

Requests go out through a sender thread that batches whatever has queued up into one message;
a reader thread receives each step's deltas and hands them to the event loop, which routes them
to per-request queues. Neither thread ever blocks the event loop, and the engine process never
waits for HTTP work. If the engine process fails or dies, every waiting request gets
`EngineDead` and `on_dead` is called once.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable

from braid import spawn
from braid.config import EngineConfig
from braid.engine.request import Request
from braid.engine.stats import EngineStats
from braid.errors import UserError
from braid.loader.model_config import ModelConfig
from braid.spawn import end_process_group
from braid.step import SequenceDelta

# The engine process's entry point, by name: this process never imports the engine's code
ENGINE_PROCESS_MAIN = "braid.engine.process:engine_process_main"
READY_TIMEOUT_S = 1800.0  # a cold start compiles its steps (minutes; tp 3 on 2 cores longer)
# Each of the engine's stops (asked, SIGTERM) gets this long before the next, harder one
STOP_TIMEOUT_S = 2.0


class EngineDead(RuntimeError):
    """The engine process failed or exited; no request can complete."""


class Aborted:
    """Put on a request's queue when the server aborts it (shutdown): all its completions end
    with finish reason "abort"."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class AsyncEngine:
    """Submit requests to the engine process and receive their deltas on asyncio queues."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not a daemon: it starts rank processes of its own.
        self.process = ctx.Process(target=spawn.run, args=(ENGINE_PROCESS_MAIN, config, child),
                                   name="braid-engine")
        self.process.start()
        child.close()
        self._queues: dict[str, asyncio.Queue] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: str | None = None  # why, once the engine is gone
        self._sequences_sent = 0
        self._stats: EngineStats | None = None  # the latest the engine sent
        self._closing = False
        self._ready = False  # the engine answered "ready": it reads its commands
        self.on_stats: Callable[[EngineStats], None] = lambda stats: None
        self.on_dead: Callable[[str], None] = lambda reason: None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ModelConfig:
        """Block until the engine has loaded the model; the model's config, read by the
        engine (this process loads no model code), or `UserError` or `EngineDead` with the
        engine's message if it could not."""
        if not self._conn.poll(timeout):
            self.close()
            raise EngineDead(f"the engine did not start within {timeout:.0f} s")
        try:
            kind, detail = self._conn.recv()
        except EOFError:
            kind, detail = "fatal", f"engine process exited (code {self.process.exitcode})"
        self._ready = kind == "ready"
        if not self._ready:
            self.close()
            if detail.startswith("error: "):
                raise UserError(detail.removeprefix("error: "))
            raise EngineDead(detail)
        return detail

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start relaying (call from the event loop that will consume the deltas)."""
        self._loop = loop
        threading.Thread(target=self._send_forever, name="braid-engine-sender",
                         daemon=True).start()
        threading.Thread(target=self._receive_forever, name="braid-engine-reader",
                         daemon=True).start()

    @property
    def queued_sequences(self) -> int:
        """Sequences submitted and not yet admitted: those the engine reported waiting, plus
        those sent since that the engine had not received yet."""
        stats = self._stats
        if stats is None:
            return self._sequences_sent
        return stats.num_waiting + self._sequences_sent - stats.num_sequences_received

    def add(self, request: Request, deltas: asyncio.Queue) -> None:
        """Submit a request; its deltas (or `EngineDead`) will arrive on `deltas`."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        self._queues[request.request_id] = deltas
        self._sequences_sent += request.params.n
        self._outbox.put(("add", request))

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or one of its completions) in the engine; frees its KV blocks."""
        self._outbox.put(("abort", request_id, index))

    def release(self, request_id: str) -> None:
        """Stop routing a request's deltas (it is finished, or its client is gone)."""
        self._queues.pop(request_id, None)

    def abort_all(self) -> None:
        """Abort every request in flight (at shutdown); each stream ends with "abort"."""
        for request_id, deltas in list(self._queues.items()):
            self.abort(request_id)
            deltas.put_nowait(Aborted(request_id))

    def close(self) -> None:
        """Stop the engine process (it stops its ranks and removes shared memory), then
        whatever it left running. A ready engine reads "stop" between steps; one still
        starting (loading, compiling) would read it only when ready, so it gets SIGTERM."""
        self._closing = True
        if self._ready:
            self._outbox.put(("stop",))
            if self._loop is None:  # relay threads never started: send directly
                try:
                    self._conn.send([("stop",)])
                except OSError:
                    pass
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        end_process_group(self.process.pid)

    def _send_forever(self) -> None:
        while True:
            batch = [self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get())
            try:
                self._conn.send(batch)
            except OSError:
                return
            if batch[-1] == ("stop",):
                return

    def _receive_forever(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if self._closing:
                    return
                self.process.join(1.0)
                code = self.process.exitcode
                self._post(self._fail, "the engine process exited" +
                           (f" (exit code {code})" if code is not None else ""))
                return
            if message[0] == "fatal":
                self._post(self._fail, message[1])
                return
            _, deltas, stats = message
            if not self._post(self._dispatch, deltas, stats):
                return

    def _post(self, callback, *args) -> bool:
        """Run `callback(*args)` on the event loop; False once the loop has closed (the server
        is shutting down and the engine's last messages have nobody to go to)."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            return False
        return True

    def _dispatch(self, deltas: list[SequenceDelta], stats: EngineStats) -> None:
        self._stats = stats
        for delta in deltas:
            target = self._queues.get(delta.request_id)
            if target is not None:
                target.put_nowait(delta)
        self.on_stats(stats)

    def _fail(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        for deltas in self._queues.values():
            deltas.put_nowait(EngineDead(reason))
        self.on_dead(reason)
