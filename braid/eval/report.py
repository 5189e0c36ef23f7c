"""What the evaluation commands write beside their figures: the run's settings, and the row
appended to a JSON-lines file."""

from __future__ import annotations

import json

from braid.config import EngineConfig


def describe_run(backend: str, engine: EngineConfig) -> dict:
    """The settings a result depends on: the backend, the model and its precision, and for
    braid the weights' form and the parallel layout."""
    described = {"backend": backend, "model": engine.model, "dtype": engine.dtype}
    if backend == "braid":
        described.update(quantization=engine.compile.quantization, tp=engine.parallel.tp,
                         comm=engine.parallel.comm, overlap=engine.switches.overlap,
                         dp_linear=engine.switches.dp_linear)
    return described


def append_row(path: str | None, row: dict) -> None:
    """Append `row` as one JSON line to `path` (nothing without a path)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
