"""Chrome/Perfetto traces of stages and collectives (`--trace FILE.json`, one file per rank).

Open a file in ui.perfetto.dev or chrome://tracing: one row per micro-batch for its stages and
one row for collectives (launch, wait start, wait end), so overlap is visible at a glance.
Inside a compiled graph nothing is recorded (it has no Python to time): a compiled step or piece
is one span, named as such.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Tracer:
    """Collects complete ("X") and instant ("i") events with microsecond timestamps."""

    def __init__(self, enabled: bool = False, rank: int = 0) -> None:
        self.enabled = enabled
        self.rank = rank
        self.events: list[dict] = []

    @contextmanager
    def span(self, name: str, row: str) -> Iterator[None]:
        if not self.enabled or torch.compiler.is_compiling():
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.events.append({"name": name, "ph": "X", "ts": start * 1e6,
                                "dur": (time.perf_counter() - start) * 1e6,
                                "pid": self.rank, "tid": row})

    def instant(self, name: str, row: str) -> None:
        if self.enabled and not torch.compiler.is_compiling():
            self.events.append({"name": name, "ph": "i", "s": "t",
                                "ts": time.perf_counter() * 1e6, "pid": self.rank, "tid": row})

    def save(self, path: str) -> str:
        """Write `path` with `.rank{r}` inserted before the extension; return that name."""
        stem, ext = os.path.splitext(path)
        target = f"{stem}.rank{self.rank}{ext or '.json'}"
        with open(target, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)
        return target


_TRACER = Tracer()


def tracer() -> Tracer:
    """This process's tracer (one rank per process; disabled unless --trace is given)."""
    return _TRACER


def enable_tracing(rank: int) -> Tracer:
    """Start recording this rank's stages and collectives (`--trace`)."""
    global _TRACER
    _TRACER = Tracer(True, rank)
    return _TRACER
