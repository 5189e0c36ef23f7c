"""Code named by a string, `"package.module:function"`, resolved where it runs.

A process that starts another (the API process its engine, the driver its ranks) names the
other's entry point instead of importing it, so that it never loads the code the other runs:
the API process holds no model code, and the driver none of the ranks'.

A started process that may start processes of its own (a rank's inductor runs g++) leads a
process group (`lead_process_group`), so that what it started is stopped with it, even when
it was killed before it could stop them itself (`end_process_group`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
from collections.abc import Callable

import psutil


def resolve(target: str | Callable) -> Callable:
    """The object `"module:name"` names (imported now), or `target` itself if it is one."""
    if callable(target):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def run(target: str, *args: object) -> object:
    """Call the function `target` names: the entry point of a spawned process."""
    return resolve(target)(*args)


def lead_process_group() -> None:
    """Make this process the leader of a process group of its own, so that the processes it
    starts (inductor's compilers: g++, cc1plus) can be stopped with it (`end_process_group`)
    even once it is gone. Its signals still come from its driver, never from the terminal:
    Ctrl-C is the driver's to handle."""
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)


def end_process_group(pgid: int) -> None:
    """SIGKILL every process left in the group `pgid` (a dead rank's or engine's compilers),
    except the calling process."""
    if pgid == os.getpid():
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if proc.pid != pgid and os.getpgid(proc.pid) == pgid:
                    proc.kill()
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
