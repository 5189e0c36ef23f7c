"""One HTTP request's generation: its prompts run as engine requests, their deltas turned into
text events by each completion's `CompletionState` (detokenization, stop strings).

Whatever ends the iteration (all completions finished, the client gone, an error), the
request's unfinished completions are aborted in the engine, so their KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from braid.engine.output import CompletionState
from braid.engine.request import Request, SamplingParams, SequenceDelta, TokenLogprob
from braid.server.async_engine import Aborted, AsyncEngine, EngineDead
from braid.server.metrics import Metrics


@dataclass
class PromptRun:
    """One prompt of an HTTP request, run as one engine request with `n` completions."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    states: list[CompletionState]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(state.finished for state in self.states)


@dataclass
class TextEvent:
    """New text (possibly empty, at the end) of one completion of one prompt."""

    prompt_index: int
    run: PromptRun
    state: CompletionState
    text: str
    logprobs: list[TokenLogprob]


def make_runs(base_id: str, prompts: list[list[int]], params: SamplingParams,
              tokenizer) -> list[PromptRun]:
    """One run per prompt, ids `{base_id}-{i}`."""
    return [PromptRun(f"{base_id}-{i}", ids, params,
                      [CompletionState(tokenizer, ids, params, k) for k in range(params.n)])
            for i, ids in enumerate(prompts)]


async def generate(engine: AsyncEngine, runs: list[PromptRun], eos_token_ids: frozenset[int],
                   metrics: Metrics) -> AsyncIterator[TextEvent]:
    """Run every prompt and yield text events as deltas arrive, until all completions end.
    Raises `EngineDead` if the engine fails meanwhile."""
    deltas: asyncio.Queue = asyncio.Queue()
    by_id = {run.request_id: (i, run) for i, run in enumerate(runs)}
    try:
        for run in runs:
            metrics.prompt_tokens.inc(len(run.prompt_ids))
            engine.add(Request(run.request_id, run.prompt_ids, run.params, eos_token_ids),
                       deltas)
        while not all(run.finished for run in runs):
            item = await deltas.get()
            if isinstance(item, EngineDead):
                raise item
            if isinstance(item, Aborted):
                i, run = by_id[item.request_id]
                for state in run.states:
                    if not state.finished:
                        state.finish_reason = "abort"
                        yield TextEvent(i, run, state, "", [])
                _finish_metrics(run, metrics)
                continue
            i, run = by_id[item.request_id]
            state = run.states[item.index]
            if state.finished:
                continue  # tokens generated before the engine saw our abort (stop string)
            _record_timing(run, item, metrics)
            if item.prompt_logprobs is not None:
                run.prompt_logprobs = [None, *item.prompt_logprobs]
            if item.num_prompt_tokens:
                run.num_cached_tokens = item.num_cached_tokens
            text, logprobs = state.update(item)
            if state.finished and item.finish_reason is None:
                engine.abort(run.request_id, item.index)  # a stop string ended it
            if run.finished:
                _finish_metrics(run, metrics)
            yield TextEvent(i, run, state, text, logprobs)
    finally:
        for run in runs:
            if not run.finished:
                engine.abort(run.request_id)
            engine.release(run.request_id)


def _record_timing(run: PromptRun, delta: SequenceDelta, metrics: Metrics) -> None:
    if not delta.new_token_ids:
        return
    now = time.monotonic()
    metrics.generation_tokens.inc(len(delta.new_token_ids))
    if run.first_token_at is None:
        run.first_token_at = now
        run.last_token_at = [now] * len(run.states)
        metrics.ttft.observe(now - run.arrival)
    elif run.states[delta.index].token_ids:
        metrics.itl.observe(now - run.last_token_at[delta.index])
    run.last_token_at[delta.index] = now


def _finish_metrics(run: PromptRun, metrics: Metrics) -> None:
    metrics.e2e.observe(time.monotonic() - run.arrival)
    for state in run.states:
        metrics.requests.labels(finished_reason=state.finish_reason).inc()


def usage(runs: list[PromptRun]) -> dict:
    """OpenAI's usage block: prompt tokens once per prompt, completion tokens of every
    completion, and the prompt tokens found in the prefix cache."""
    prompt = sum(len(run.prompt_ids) for run in runs)
    completion = sum(len(state.token_ids) for run in runs for state in run.states)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in runs)}}
