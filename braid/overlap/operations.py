"""Models as flat lists of operations with yield points, run straight or as two micro-batches.

A layer exposes `operations()`: callables `op(state, batch)` and `YIELD` markers. An operation
that launches a collective stores its `Pending` in the micro-batch's `State`; the first operation
after the next `YIELD` waits on it. `execute` ignores the yields (the plain forward pass);
`execute_overlapped` runs stage k of micro-batch A, then stage k of B, then stage k+1 of A, so
A's collective is in flight while B computes, and the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from braid.trace import tracer


class _Yield:
    def __repr__(self) -> str:
        return "YIELD"


YIELD = _Yield()
Operation = Callable[["State", Any], None]


def between_pieces(op: Callable) -> Callable:
    """Mark an operation that compiled pieces of a step end before and resume after, so that it
    runs eager (`braid.worker.compiled_step`): one that reads the step's per-sequence metadata,
    Python values a graph would specialise on (attention over sequences of any lengths). A
    decode step's whole graph still traces it (its metadata is tensors there)."""
    op.between_pieces = True
    return op


def is_between_pieces(op: Operation) -> bool:
    return getattr(op, "between_pieces", False)


class StateError(RuntimeError):
    """An operation list misuses its state: an overwrite, a missing value, or a leak."""


class State:
    """Values one micro-batch passes between operations.

    `put` refuses to overwrite (two producers, or a value never consumed) and the state must be
    empty once the outputs are taken, so a forgotten wait or a leaked tensor fails loudly.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._values: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        if key in self._values:
            raise StateError(f"micro-batch {self.name!r}: {key!r} is already set; "
                             "its previous value was never consumed")
        self._values[key] = value

    def take(self, key: str) -> Any:
        try:
            return self._values.pop(key)
        except KeyError:
            raise StateError(f"micro-batch {self.name!r}: {key!r} was never produced") from None

    def check_empty(self) -> None:
        if self._values:
            raise StateError(f"micro-batch {self.name!r} finished with {sorted(self._values)} "
                             "left in its state (a collective never waited, or a leaked value)")


def split_stages(ops: Sequence[Operation | _Yield]) -> list[list[Operation]]:
    """Operations grouped into stages at the yields (empty stages dropped)."""
    stages: list[list[Operation]] = [[]]
    for op in ops:
        if op is YIELD:
            stages.append([])
        else:
            stages[-1].append(op)
    return [stage for stage in stages if stage]


def _run_stage(stage: list[Operation], state: State, batch: Any, index: int) -> None:
    with tracer().span(f"stage {index}", state.name):
        for op in stage:
            op(state, batch)


def _finish(state: State, outputs: Sequence[str]) -> dict[str, Any]:
    values = {key: state.take(key) for key in outputs}
    state.check_empty()
    return values


def execute(ops: Sequence[Operation | _Yield], batch: Any,
            outputs: Sequence[str] = ("logits",), inputs: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """Run the operations in order for one batch (yields ignored), their state starting with
    `inputs`; return the outputs."""
    state = State("A")
    for key, value in (inputs or {}).items():
        state.put(key, value)
    for index, stage in enumerate(split_stages(ops)):
        _run_stage(stage, state, batch, index)
    return _finish(state, outputs)


def execute_overlapped(ops: Sequence[Operation | _Yield], batch_a: Any, batch_b: Any,
                       delta_stages: int = 0, outputs: Sequence[str] = ("logits",)
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Braid two micro-batches through the same operations.

    A runs `delta_stages` stages ahead, then the two alternate A, B, A, B, then B drains.
    """
    stages = split_stages(ops)
    state_a, state_b = State("A"), State("B")
    order = [("A", k) for k in range(min(delta_stages, len(stages)))]
    for k in range(len(stages)):
        if k + delta_stages < len(stages):
            order.append(("A", k + delta_stages))
        order.append(("B", k))
    for which, k in order:
        if which == "A":
            _run_stage(stages[k], state_a, batch_a, k)
        else:
            _run_stage(stages[k], state_b, batch_b, k)
    return _finish(state_a, outputs), _finish(state_b, outputs)
