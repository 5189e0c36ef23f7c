"""Tensor-parallel ranks as processes, behind one interface (`RankGroup`).

`launch_ranks` spawns the ranks on this host (`local.LocalRankGroup`) or, when torchrun started
this process, adopts torchrun's ranks, possibly on several hosts (`torchrun.TorchrunRankGroup`).
Either way the calling process is the driver: it sends each rank messages, receives rank 0's
answers, and hears within its timeout when a rank failed or died, as a `RankFailure` naming
that rank's error: a launch never hangs on a dead peer.

A rank's entry point is `target(rank, world_size, conn, *args)`, given as a function or by name
(`"module:function"`, `braid.spawn`) so that the driver need not import the rank's code. It
receives messages with `conn.recv()` and answers with `conn.send(("ok", value))`;
`torch.distributed` is initialised before it runs, and its exceptions reach the driver.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Protocol

from braid.errors import UserError

# Errors a rank gets when a peer died under it, as opposed to the peer's own error.
PEER_FAILURE_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")

# A rank's entry point, or its name (`braid.spawn.resolve`)
Target = Callable | str


class RankFailure(RuntimeError):
    """A rank raised or died; the message carries that rank's error."""


class RankGroup(Protocol):
    """The driver's side of a launch's ranks."""

    @property
    def world_size(self) -> int: ...

    def send_all(self, message: object) -> None:
        """Send the same message to every rank."""

    def send(self, rank: int, message: object) -> None:
        """Send a message to one rank (rank 0's grammar masks: only it samples)."""

    def recv(self, rank: int = 0, timeout: float | None = None) -> object:
        """`rank`'s next answer; `RankFailure` if any rank failed meanwhile."""

    def gather(self, timeout: float | None = None) -> list[object]:
        """One answer from every rank this process drives, in rank order."""

    def request(self, message: object) -> object:
        """Send to every rank and return rank 0's answer."""

    def check_alive(self) -> None:
        """Raise `RankFailure` if a rank has failed (for a driver not waiting on one)."""

    def close(self) -> None:
        """Stop every rank and run the launch's cleanup (idempotent)."""


def check_not_bootstrapping() -> None:
    """Refuse to start ranks from a spawned process that is still importing its parent's
    main module: the script created an engine at import time, without the main guard."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise UserError(
            "an engine was created while a braid rank process was starting: ranks are spawned, "
            "which imports your script again, so the code that creates the engine (LLM(...)) "
            "must not run at import time. Put it under `if __name__ == \"__main__\":` "
            "(see the README's Python API example)")


def launch_ranks(world_size: int, target: Target, args: tuple,
                 cleanup: Callable[[], str | None] | None, timeout_s: float) -> RankGroup:
    """Adopt torchrun's ranks when it started this process (a lost host is noticed within
    `timeout_s`), else spawn ranks on this host."""
    from braid.distributed.ranks.local import LocalRankGroup
    from braid.distributed.ranks.torchrun import TorchrunRankGroup, torchrun_rank

    check_not_bootstrapping()
    if torchrun_rank() is not None:
        return TorchrunRankGroup(world_size, target, args, cleanup, timeout_s)
    return LocalRankGroup(world_size, target, args, cleanup)
