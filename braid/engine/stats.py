"""What the engine core reports of itself, step by step: load, totals, the paths steps took.
The server's API process receives it with every step's deltas (`/metrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from braid.engine.grammar import GrammarTimes


@dataclass
class EngineStats:
    """Counters and gauges for metrics: current load, and totals since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_steps_overlap: int
    num_steps_dp_linear: int
    steps_by_path: dict[str, int]  # `StepResult.path` -> steps that took it
    num_sequences_received: int = 0  # every sequence of every request `add` was given
    num_draft_tokens: int = 0  # tokens proposed by speculative decoding and verified
    num_accepted_tokens: int = 0  # ... and accepted
    step_choices: dict[str, str] = field(default_factory=dict)  # `auto`'s, by step bucket
    num_probe_steps: int = 0  # steps `auto` ran to measure a setting
    grammar: GrammarTimes = field(default_factory=GrammarTimes)
    memory: list[RankMemory] = field(default_factory=list)  # per rank


@dataclass(frozen=True)
class RankMemory:
    """What a rank holds: its weights in every form, its KV cache, and its process's resident
    memory (0 where the rank runs on another host and its process cannot be read)."""

    weight_bytes: int
    kv_cache_bytes: int
    resident_bytes: int
