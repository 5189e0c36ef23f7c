"""Sampling parameters and the per-request state the scheduler tracks."""

from __future__ import annotations

from dataclasses import dataclass, field

from braid.config import UserError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's defaults: temperature 1, no top-k/top-p)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")


@dataclass
class Sequence:
    """One request being generated: its tokens, KV blocks and progress."""

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the cache
    scheduled_tokens: int = 0  # tokens the current step computes
    finish_reason: str | None = None

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence (the
        scheduler asks for the newest token of every sequence at every decode step)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:end] + self.output_ids[:max(0, end - n)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A finished request: the prompt, the generated text and token ids."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
