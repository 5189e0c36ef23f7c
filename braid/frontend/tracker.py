"""A front end's view of its requests: each completion's tokens, text and end, built from the
engine core's `SequenceDelta`s. The offline `LLM` and the server's API process both follow
their requests with a `CompletionTracker`, so a delta means the same to both: a stop string or
a detokenizer failure ends a completion on this side, which then tells the engine to stop it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from braid.engine.request import SamplingParams
from braid.errors import request_failure
from braid.frontend.detokenizer import IncrementalDetokenizer
from braid.step import SequenceDelta, TokenLogprob


class CompletionState:
    """What a front end knows of one completion: its tokens, text, logprobs and end."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams,
                 index: int = 0) -> None:
        self.index = index
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids,
                                                  params.skip_special_tokens, params.stop)
        self.token_ids: list[int] = []
        wants_logprobs = params.logprobs is not None or bool(params.logprob_token_ids)
        self.logprobs: list[TokenLogprob] | None = [] if wants_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.invalid = False  # the error is the request's own (`SequenceDelta.invalid`)
        self.param: str | None = None  # where invalid: the request field at fault
        self.embedding: np.ndarray | None = None  # a pooling request's vector

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def fail(self, error: str) -> None:
        """End the completion with an error (the caller aborts it in the engine)."""
        self.finish_reason, self.error = "error", error

    def update(self, delta: SequenceDelta) -> tuple[str, list[TokenLogprob]]:
        """Apply an engine delta; return the text to emit now and the logprobs of the tokens
        it covers. After a stop string the completion is finished (the caller aborts it in
        the engine) and later deltas are ignored."""
        if self.finished:
            return "", []
        self.token_ids += delta.new_token_ids
        if delta.embedding is not None:
            self.embedding = delta.embedding
        new_logprobs = delta.logprobs or []
        if self.logprobs is not None:
            self.logprobs += new_logprobs
        ending = delta.finish_reason is not None
        # A stop token (EOS or one of stop_token_ids) ends the completion without its text.
        text_ids = delta.new_token_ids[:-1] if delta.by_stop_token else delta.new_token_ids
        piece = self.detokenizer.add(text_ids, final=ending,
                                     check_stop=len(self.token_ids) >= self.params.min_tokens)
        if self.detokenizer.stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", self.detokenizer.stop_string
        elif ending:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.error, self.invalid, self.param = delta.error, delta.invalid, delta.param
        return piece, new_logprobs


@dataclass
class CompletionOutput:
    """One finished completion of a request (`error` says why when finish_reason is
    "error": only this request failed)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    """A finished request: the prompt and its `n` completions (`text`, `token_ids` and
    `finish_reason` are the first completion's)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


@dataclass
class Applied:
    """What one delta did to one completion: the text and logprobs to emit now, and whether
    the engine must be asked to stop the completion (`abort`: it ended on this side, by a stop
    string or a detokenizer failure, while the engine would go on)."""

    completion: CompletionState
    text: str
    logprobs: list[TokenLogprob]
    abort: bool


class CompletionTracker:
    """One prompt's engine request as a front end follows it: its `n` completions
    (`CompletionState`), and what the engine reports once for the prompt (its logprobs, its
    tokens found in the prefix cache)."""

    def __init__(self, request_id: str, tokenizer, prompt_ids: list[int],
                 params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.completions = [CompletionState(tokenizer, prompt_ids, params, index)
                            for index in range(params.n)]
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(completion.finished for completion in self.completions)

    def apply(self, delta: SequenceDelta) -> Applied | None:
        """Apply an engine delta of this request; None where its completion had already ended
        (tokens the engine generated before it saw the abort)."""
        completion = self.completions[delta.index]
        if completion.finished:
            return None
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None, *delta.prompt_logprobs]
        if delta.num_prompt_tokens:
            self.num_cached_tokens = delta.num_cached_tokens
        try:
            text, logprobs = completion.update(delta)
        except Exception as e:  # noqa: BLE001 - this completion's text failed, not the others
            completion.fail(request_failure("detokenizing", e))
            text, logprobs = "", []
        ended_here = completion.finished and delta.finish_reason is None
        return Applied(completion, text, logprobs, ended_here)

    def output(self, prompt: str | None) -> RequestOutput:
        """The finished request, as `LLM.generate` returns it."""
        return RequestOutput(prompt, self.prompt_ids, [
            CompletionOutput(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
                             c.logprobs, c.error) for c in self.completions],
            self.prompt_logprobs, self.num_cached_tokens)
