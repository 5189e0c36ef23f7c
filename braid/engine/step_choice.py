"""`auto` that learns: which setting of the per-step switches (two-batch overlap, DP linear,
compressed partial sums) runs fastest, measured while serving, per step-size bucket.

Whether overlap pays depends on how long a collective takes against the compute it can hide
behind, which depends on the link, the backend, the model and the step's size; fixed token
thresholds were measured on one host and are wrong on the next. So each bucket (decode or
prefill, by its token count's power of four: a server's steps spread over few of them) probes
every setting the `auto` switches allow:

1. a setting's first step anywhere is not timed (it pays one-time costs: kernels, compiled
   pieces);
2. then up to `PROBES` timed steps each, round robin; a setting `CLEARLY_SLOWER` than the
   best after one timed step is dropped early, so a slow link costs few slow probes, and a
   bucket does not probe the settings its nearest decided neighbour of the same kind found
   clearly slower (a server's prefill steps spread over several buckets, each seen rarely);
3. then the setting with the least median time per token, until its recent median drifts
   `DRIFT` away from what it was when chosen (the link or the load changed) or `RECHECK_STEPS`
   steps pass: then the bucket probes again.

Steps are timed by the engine around the whole step (the ranks' forward and sampling), so what
is compared is what a client waits for.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median

from braid.config import StepSwitches

PROBES = 2
CLEARLY_SLOWER = 1.3
DRIFT = 0.25
WINDOW = 8  # the chosen setting's recent steps, for drift
RECHECK_STEPS = 2000

# A setting: (switch, value) pairs in a fixed order, e.g. (("overlap", True), ("compression",
# "int8")).
Setting = tuple[tuple[str, object], ...]


def switch_options(mode: str, num_tokens: int, min_tokens: int | None,
                   applies: bool) -> tuple[bool, ...]:
    """The values a per-step optimisation may take for a step of `num_tokens`: `on`, `off`, or
    for `auto` where it `applies` (several ranks), from `min_tokens` tokens per step where that
    threshold is given, else both, for the engine to learn which is faster."""
    if mode != "auto":
        return (mode == "on",)
    if not applies:
        return (False,)
    if min_tokens is not None:
        return (num_tokens >= min_tokens,)
    return (False, True)


def step_settings(switches: StepSwitches, num_tokens: int, tp: int, has_dp_linear: bool,
                  compression_learned: bool, graph_decode: bool = False) -> list[Setting]:
    """Every setting of the per-step switches that a step of `num_tokens` may run with: DP
    linear only for a model that has it, compression learned only where `compression_learned`
    (the ranks span hosts), no overlap under `auto` for a decode step that a compiled decode
    graph runs (`graph_decode`): the graph holds no overlap, and probing one would compile the
    staged pieces for that size in the middle of serving, a stall of seconds in whichever
    request met it (a speculative verification's rows did)."""
    several = tp > 1
    overlap = switch_options(switches.overlap, num_tokens, switches.overlap_min_tokens,
                             several and num_tokens > 1 and not graph_decode)
    # A model without DP linear leaves it out (`auto`'s choices then do not name it).
    dp_linear = switch_options(switches.dp_linear, num_tokens, switches.dp_linear_min_tokens,
                               several) if has_dp_linear else None
    compression = ((("none", "int8") if compression_learned else ("none",))
                   if switches.comm_compression == "auto" else (switches.comm_compression,))
    return [(("overlap", o), *((("dp_linear", d),) if dp_linear else ()), ("compression", c))
            for o in overlap for d in dp_linear or (False,) for c in compression]


def describe(setting: Setting) -> str:
    """`overlap=on compression=int8`."""
    names = {True: "on", False: "off"}
    return " ".join(f"{k}={names.get(v, v) if isinstance(v, bool) else v}" for k, v in setting)


def step_bucket(num_tokens: int, decode: bool) -> str:
    """`decode:64` for a decode step of 17-64 rows, `prefill:4096` for 1025-4096 tokens."""
    size = 4 ** max(0, math.ceil(math.log(max(num_tokens, 1), 4) - 1e-9))
    return f"{'decode' if decode else 'prefill'}:{size}"


@dataclass
class _Bucket:
    samples: dict[Setting, list[float]] = field(default_factory=dict)  # timed probes
    chosen: Setting | None = None
    chosen_time: float = 0.0  # its median time per token when chosen
    medians: dict[Setting, float] = field(default_factory=dict)  # every setting's, then
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    steps_since_choice: int = 0

    def probe_next(self, candidates: list[Setting], seen: set[Setting]) -> Setting | None:
        """The setting to probe next (one not yet `seen` first), or None when every one is
        settled."""
        for setting in candidates:
            if setting not in seen:
                return setting
        timed = {s: median(self.samples[s]) for s in candidates if self.samples.get(s)}
        best = min(timed.values(), default=math.inf)
        open_ = [s for s in candidates if len(self.samples.get(s, ())) < PROBES
                 and not timed.get(s, 0.0) > CLEARLY_SLOWER * best]
        return min(open_, key=lambda s: len(self.samples.get(s, ())), default=None)


class StepChooser:
    """Chooses each step's setting among `candidates` and learns from its time (`observe`)."""

    def __init__(self) -> None:
        self.buckets: dict[str, _Bucket] = {}
        self.seen: set[Setting] = set()  # settings run once (untimed)
        self.probe_steps = 0  # steps that ran a setting to measure it

    def choose(self, bucket: str, candidates: list[Setting]) -> tuple[Setting, bool]:
        """The setting for a step of `bucket`, and whether it is a probe."""
        if len(candidates) == 1:
            return candidates[0], False
        state = self.buckets.setdefault(bucket, _Bucket())
        if state.chosen in candidates:
            return state.chosen, False
        state.chosen = None
        candidates = self._worth_probing(bucket, candidates)
        setting = state.probe_next(candidates, self.seen)
        if setting is not None:
            self.probe_steps += 1
            return setting, True
        timed = {s: median(self.samples_of(state, s)) for s in candidates}
        state.chosen = min(timed, key=timed.get)
        state.chosen_time, state.medians = timed[state.chosen], timed
        state.recent.clear()
        state.steps_since_choice = 0
        return state.chosen, False

    def _worth_probing(self, bucket: str, candidates: list[Setting]) -> list[Setting]:
        """`candidates` less those the nearest decided bucket of the same kind found clearly
        slower than its best (all of them where none has decided)."""
        kind, size = bucket.split(":")
        decided = [(abs(math.log(int(other.split(":")[1]) / int(size))), other)
                   for other, state in self.buckets.items()
                   if state.chosen is not None and other.split(":")[0] == kind]
        if not decided:
            return candidates
        medians = self.buckets[min(decided)[1]].medians
        best = min(medians.values())
        kept = [s for s in candidates if not medians.get(s, 0.0) > CLEARLY_SLOWER * best]
        return kept or candidates

    @staticmethod
    def samples_of(state: _Bucket, setting: Setting) -> list[float]:
        return state.samples.get(setting) or [math.inf]

    def observe(self, bucket: str, setting: Setting, seconds: float, tokens: int) -> None:
        """A step of `bucket` ran with `setting` in `seconds`."""
        state = self.buckets.get(bucket)
        if state is None:
            return  # a single candidate: nothing to learn
        per_token = seconds / max(tokens, 1)
        if setting not in self.seen:
            self.seen.add(setting)
        elif state.chosen is None:
            state.samples.setdefault(setting, []).append(per_token)
        elif setting == state.chosen:
            state.recent.append(per_token)
            state.steps_since_choice += 1
            drifted = (len(state.recent) == WINDOW
                       and abs(median(state.recent) / state.chosen_time - 1) > DRIFT)
            if drifted or state.steps_since_choice >= RECHECK_STEPS:
                state.chosen = None  # probe again (settings stay warm: no untimed steps)
                state.samples.clear()

    def choices(self) -> dict[str, str]:
        """Each bucket's chosen setting, or `probing`."""
        return {bucket: describe(state.chosen) if state.chosen else "probing"
                for bucket, state in sorted(self.buckets.items())}
