"""The engine process: an `EngineCore` driven in a loop, fed over a pipe by the API process.

Each turn of the loop takes every command that has arrived (batches of adds and aborts), runs
one step if anything is waiting or running, and sends back one message with the step's deltas
and the engine's stats. A request the engine refuses fails alone (an error delta); anything
else that goes wrong (a rank died) is sent as "fatal", and the process stops its ranks, which
removes their shared memory, and exits non-zero.
"""

from __future__ import annotations

import gc
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from braid.config import EngineConfig
from braid.distributed.ranks import RankFailure
from braid.distributed.ranks.local import exit_with_parent
from braid.engine.core import EngineCore, EngineError
from braid.engine.executor import RankExecutor
from braid.engine.request import Request
from braid.errors import UserError, request_failure
from braid.loader.model_config import load_model_config
from braid.spawn import lead_process_group
from braid.step import SequenceDelta

IDLE_POLL_S = 0.05  # how often an idle engine checks its ranks
GRAMMAR_POLL_S = 0.005  # how often it checks on grammars compiling, when it has nothing else


def engine_process_main(config: EngineConfig, conn: Connection) -> None:
    """Entry point: build the engine (answer "ready" with the model's config, or "fatal"),
    then serve until "stop". SIGTERM (the API process stopping it before it is ready, or
    after it failed to stop in time) ends it at once, with its ranks and their compilers."""
    lead_process_group()
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the API process's to handle
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    executor = None
    try:
        model_config = load_model_config(config.model, config.cache)
        executor = RankExecutor(config, model_config)
        executor.wait_ready()
    except SystemExit:
        if executor is not None:  # stopped while the ranks load: they stop too
            executor.close()
        raise
    except UserError as e:
        conn.send(("fatal", f"error: {e}"))
        sys.exit(2)
    except BaseException as e:  # noqa: BLE001 - reported, then this process ends
        conn.send(("fatal", _describe(e)))
        sys.exit(1)
    core = EngineCore(config, model_config, executor)
    try:
        core.compile_steps()  # a server compiles at start (--compile auto or on)
        core.grammars.prepare_in_background()
        conn.send(("ready", model_config))  # the API process reads no checkpoint of its own
        try:
            serve(core, conn)
        except (EOFError, OSError):
            pass  # the API process is gone
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - reported, then this process ends
        conn.send(("fatal", _describe(e)))
        sys.exit(1)
    finally:
        core.close()
        gc.freeze()  # the process ends: Python's last collections over the model took a second


def _describe(e: BaseException) -> str:
    if isinstance(e, (RankFailure, EngineError)):
        return f"engine failed: {e}"
    return "engine failed:\n" + "".join(traceback.format_exception(e))


def serve(core: EngineCore, conn: Connection) -> None:
    """Take commands and step until told to stop. Grammars compile in the grammar thread
    meanwhile (`EngineCore.compile_grammars_aside`): a flood of large schemas never stalls
    the running sequences' steps."""
    core.compile_grammars_aside = True
    while True:
        refused: list[SequenceDelta] = []
        commands: list[tuple] = []
        wait_s = 0 if core.has_work else GRAMMAR_POLL_S if core.num_compiling else IDLE_POLL_S
        if conn.poll(wait_s):
            while True:
                commands += conn.recv()
                if not conn.poll(0):
                    break
        for command in commands:
            if command[0] == "stop":
                return
            if command[0] == "add":
                try:
                    core.add(command[1])
                except Exception as e:  # noqa: BLE001 - a request's own fault fails it alone
                    refused += _refusal(command[1], e)
            elif command[0] == "abort":
                core.abort(*command[1:])
        for request, error in core.admit_compiled():
            refused += _refusal(request, error)
        stepped = core.has_work
        if stepped:
            deltas = core.step()
        else:
            core.executor.check_alive()
            deltas = []
        # Every step too: its admissions change what the API counts
        if commands or refused or stepped:
            conn.send(("outputs", refused + deltas, core.stats()))


def _refusal(request: Request, e: Exception) -> list[SequenceDelta]:
    """An error delta for each of the sequences of a request the engine refused. A
    `UserError` is the request's (a grammar that does not compile for this vocabulary, say):
    a 400 naming its field."""
    invalid = isinstance(e, UserError)
    error = str(e) if invalid else request_failure("adding the request", e)
    return [SequenceDelta(request.request_id, i, finish_reason="error", error=error,
                          invalid=invalid, param=getattr(e, "param", None))
            for i in range(request.params.n)]
