"""One HTTP request's generation: its prompts run as engine requests, their deltas turned into
text events by each prompt's `CompletionTracker` (detokenization, stop strings).

Whatever ends the iteration (all completions finished, the client gone, an error), the
request's unfinished completions are aborted in the engine, so their KV blocks are freed. A
completion whose text cannot be made (a detokenizer failure) ends with an error alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from braid.engine.request import Request, SamplingParams
from braid.frontend.tracker import CompletionState, CompletionTracker
from braid.server.async_engine import Aborted, AsyncEngine, EngineDead
from braid.server.metrics import Metrics
from braid.step import SequenceDelta, TokenLogprob


class PromptRun(CompletionTracker):
    """One prompt of an HTTP request, run as one engine request with `n` completions, and
    when its tokens arrived (for the latency metrics)."""

    def __init__(self, request_id: str, tokenizer, prompt_ids: list[int],
                 params: SamplingParams, group: str) -> None:
        super().__init__(request_id, tokenizer, prompt_ids, params)
        self.group = group  # the HTTP request's id: admission takes turns between groups
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: list[float] = []


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
    """One run per prompt, ids `{base_id}-{i}`, all in group `base_id`."""
    return [PromptRun(f"{base_id}-{i}", tokenizer, ids, params, base_id)
            for i, ids in enumerate(prompts)]


def submit(engine: AsyncEngine, runs: list[PromptRun], eos_token_ids: frozenset[int],
           metrics: Metrics) -> asyncio.Queue:
    """Send every prompt to the engine now, so that admission control counts them before the
    next request is looked at; the queue their deltas arrive on. Whoever submits must end
    with `close` (`generate` does, and so must a response that never starts it)."""
    deltas: asyncio.Queue = asyncio.Queue()
    try:
        for run in runs:
            metrics.prompt_tokens.inc(len(run.prompt_ids))
            engine.add(Request(run.request_id, run.prompt_ids, run.params, eos_token_ids,
                               group=run.group), deltas)
    except BaseException:
        close(engine, runs)
        raise
    return deltas


def close(engine: AsyncEngine, runs: list[PromptRun]) -> None:
    """Abort the runs' unfinished completions in the engine (their KV blocks are freed) and
    stop routing their deltas. Idempotent."""
    for run in runs:
        if not run.finished:
            engine.abort(run.request_id)
        engine.release(run.request_id)


async def generate(engine: AsyncEngine, runs: list[PromptRun], deltas: asyncio.Queue,
                   metrics: Metrics) -> AsyncIterator[TextEvent]:
    """Yield text events of submitted runs as their deltas arrive, until all completions
    end; then `close` them, however the iteration ends. Raises `EngineDead` if the engine
    fails meanwhile."""
    by_id = {run.request_id: (i, run) for i, run in enumerate(runs)}
    unfinished = sum(len(run.completions) for run in runs)
    try:
        while unfinished:
            item = await deltas.get()
            if isinstance(item, EngineDead):
                raise item
            if isinstance(item, Aborted):
                i, run = by_id[item.request_id]
                for state in run.completions:
                    if not state.finished:
                        state.finish_reason = "abort"
                        unfinished -= 1
                        yield TextEvent(i, run, state, "", [])
                _finish_metrics(run, metrics)
                continue
            i, run = by_id[item.request_id]
            if run.completions[item.index].finished:
                continue  # tokens generated before the engine saw our abort (stop string)
            _record_timing(run, item, metrics)
            applied = run.apply(item)
            state = applied.completion
            if state.finished:
                unfinished -= 1
                if applied.abort:
                    engine.abort(run.request_id, item.index)  # a stop string or a failure
                if run.finished:
                    _finish_metrics(run, metrics)
            yield TextEvent(i, run, state, applied.text, applied.logprobs)
    finally:
        close(engine, runs)


def _record_timing(run: PromptRun, delta: SequenceDelta, metrics: Metrics) -> None:
    if not delta.new_token_ids:
        return
    now = time.monotonic()
    metrics.generation_tokens.inc(len(delta.new_token_ids))
    if run.first_token_at is None:
        run.first_token_at = now
        run.last_token_at = [now] * len(run.completions)
        metrics.ttft.observe(now - run.arrival)
    elif run.completions[delta.index].token_ids:
        metrics.itl.observe(now - run.last_token_at[delta.index])
    run.last_token_at[delta.index] = now


def _finish_metrics(run: PromptRun, metrics: Metrics) -> None:
    metrics.e2e.observe(time.monotonic() - run.arrival)
    for state in run.completions:
        metrics.requests.labels(finished_reason=state.finish_reason).inc()


def usage(runs: list[PromptRun], report_cached: bool = True) -> dict:
    """OpenAI's usage block: prompt tokens once per prompt, completion tokens of every
    completion, and (`report_cached`) the prompt tokens found in the prefix cache."""
    prompt = sum(len(run.prompt_ids) for run in runs)
    completion = sum(len(state.token_ids) for run in runs for state in run.completions)
    block = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion}
    if report_cached:
        block["prompt_tokens_details"] = {"cached_tokens": sum(r.num_cached_tokens
                                                               for r in runs)}
    return block
