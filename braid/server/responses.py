"""OpenAI response bodies and SSE streams, built from a request's text events: completions
(choices indexed prompt * n + completion, echo, the legacy logprobs object) and chat
completions (message / delta, the `content` logprobs list)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from braid.server.async_engine import EngineDead
from braid.server.chat_tools import ChoiceTools, ToolOutput
from braid.server.generation import PromptRun, TextEvent, usage
from braid.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from braid.step import TokenLogprob


class _Stream(StreamingResponse):
    """A streaming response that calls `on_close` when it ends, however it ends (also when
    the client left before the body began, so the generator never ran)."""

    def __init__(self, content, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(chunks: AsyncIterator[dict], on_close: Callable[[], None], typed: bool = False,
        stopped: Callable[[], dict | None] = lambda: None) -> StreamingResponse:
    """Server-sent events: OpenAI's chat and completion chunks as `data:` lines ending with
    `data: [DONE]`, or (`typed`) events named by their `type` field, as the Responses and
    Anthropic's Messages streams send them, with no end marker. `stopped` makes the last event
    when the engine stops meanwhile (None: an error in OpenAI's shape)."""

    def line(chunk: dict) -> str:
        data = f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        return f"event: {chunk['type']}\n{data}" if typed else data

    async def lines() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield line(chunk)
        except EngineDead:  # why is in the server's log
            yield line(stopped() or error_body("the engine stopped", "server_error"))
        if not typed:
            yield "data: [DONE]\n\n"

    return _Stream(lines(), on_close)


class TokenText:
    """Token strings for logprobs, cached by id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


class _Responder:
    """Shared by the completions and chat responders: ids, timestamps, error chunks."""

    object_name = ""
    typed_events = False  # `sse`'s: chunks as `data:` lines ending with [DONE]

    def __init__(self, tokenizer, model_name: str, body, runs: list[PromptRun],
                 report_cached: bool = True) -> None:
        self.model_name, self.request, self.runs = model_name, body, runs
        self.report_cached = report_cached
        self.id = runs[0].request_id.rsplit("-", 1)[0]
        self.created = int(time.time())
        self.token_text = TokenText(tokenizer)

    def envelope(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model_name, "choices": choices, **extra}

    def stopped_event(self) -> dict | None:
        """The stream's last event when the engine stops (None: `sse`'s default)."""
        return None

    def include_usage(self) -> bool:
        return bool(self.request.stream_options and self.request.stream_options.include_usage)

    def usage(self) -> dict:
        return usage(self.runs, self.report_cached)

    def prompt_logprobs(self, run: PromptRun) -> dict:
        """vLLM's `prompt_logprobs` of a prompt where the request asks for them (else {}):
        None for the first token, then by token id the token's own and its top alternatives'
        logprob, vocabulary rank and text."""
        k = self.request.prompt_logprobs
        if k is None:
            return {}
        scored = []
        for token_id, entry in zip(run.prompt_ids, run.prompt_logprobs or []):
            if entry is None:
                scored.append(None)
                continue
            ranked = {token_id: (entry.logprob, entry.rank)}
            for rank, (other, logprob) in enumerate(entry.top[:k], start=1):
                ranked.setdefault(other, (logprob, rank))
            scored.append({str(t): {"logprob": lp, "rank": rank,
                                    "decoded_token": self.token_text(t)}
                           for t, (lp, rank) in ranked.items()})
        return {"prompt_logprobs": scored}

    def error_chunk(self, event: TextEvent) -> dict | None:
        state = event.state
        if state.finish_reason == "error":  # the request's own fault (invalid) or the server's
            return error_body(f"generation failed: {state.error}",
                              "invalid_request_error" if state.invalid else "server_error",
                              state.param if state.invalid else None)
        return None


class CompletionResponder(_Responder):
    """`/v1/completions` responses: choices indexed prompt * n + completion."""

    object_name = "text_completion"

    def __init__(self, tokenizer, model_name: str, body: CompletionRequest,
                 runs: list[PromptRun], texts: list[str | None],
                 report_cached: bool = True) -> None:
        super().__init__(tokenizer, model_name, body, runs, report_cached)
        # Echo's text of each prompt (token-id prompts decoded only when echoed)
        self.prompt_texts = [t if t is not None or not body.echo
                             else tokenizer.decode(run.prompt_ids) for t, run in zip(texts, runs)]
        self._echo_cache: dict[str, dict] = {}

    def choice_index(self, prompt_index: int, state) -> int:
        return prompt_index * self.request.n + state.index

    def response(self) -> dict:
        choices = []
        for i, run in enumerate(self.runs):
            for state in run.completions:
                text = (self.prompt_texts[i] if self.request.echo else "") + state.text
                logprobs = None
                if self.request.logprobs is not None:
                    logprobs = self._with_echo(self._echoed(run), list(state.logprobs), 0)
                choices.append({"index": self.choice_index(i, state), "text": text,
                                "logprobs": logprobs, "finish_reason": state.finish_reason,
                                "stop_reason": state.stop_reason,
                                **self.prompt_logprobs(run)})
        return self.envelope(choices, usage=self.usage())

    async def chunks(self, events: AsyncIterator[TextEvent]) -> AsyncIterator[dict]:
        offsets: dict[int, int] = {}
        pending: dict[int, list] = {}  # logprobs of tokens whose text is held back
        echo_due: set[int] = set()  # choices whose next chunk carries the prompt's logprobs
        async for event in events:
            if (error := self.error_chunk(event)) is not None:
                yield error
                continue
            index = self.choice_index(event.prompt_index, event.state)
            text = event.text
            entries = pending.setdefault(index, [])
            scored = {}
            if index not in offsets:  # the first chunk of a choice carries the prompt's
                offsets[index] = 0
                scored = self.prompt_logprobs(event.run)
                if self.request.echo:
                    text = self.prompt_texts[event.prompt_index] + text
                    echo_due.add(index)
            entries += event.logprobs
            finish = event.state.finish_reason
            if not text and finish is None and not scored:
                continue
            logprobs = None
            if self.request.logprobs is not None:
                echoed = self._echoed(event.run) if index in echo_due else None
                logprobs = self._with_echo(echoed, entries, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs["tokens"])
            echo_due.discard(index)
            pending[index] = []
            yield self.envelope([{"index": index, "text": text, "logprobs": logprobs,
                                  "finish_reason": finish,
                                  "stop_reason": event.state.stop_reason if finish else None,
                                  **scored}])
        if self.include_usage():
            yield self.envelope([], usage=self.usage())

    def _echoed(self, run: PromptRun) -> dict | None:
        """The prompt's logprobs object for echo (None without echo), made once per prompt
        and shared by its n choices."""
        if not self.request.echo:
            return None
        if run.request_id not in self._echo_cache:
            self._echo_cache[run.request_id] = self._logprobs(self._prompt_entries(run), 0)
        return self._echo_cache[run.request_id]

    def _with_echo(self, echoed: dict | None, entries: list, offset: int) -> dict:
        """The logprobs object of generated `entries` from text offset `offset`, after the
        prompt's (`echoed`, which starts at `offset`) where there is one."""
        if echoed is None:
            return self._logprobs(entries, offset)
        generated = self._logprobs(entries, offset + sum(len(t) for t in echoed["tokens"]))
        return {key: echoed[key] + generated[key] for key in echoed}

    def _prompt_entries(self, run: PromptRun) -> list:
        """Echo: (token id, entry) of every prompt token; the first has no logprob."""
        entries = run.prompt_logprobs or [None] * len(run.prompt_ids)
        return list(zip(run.prompt_ids, entries))

    def _logprobs(self, entries: list, offset: int) -> dict:
        """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset.
        `entries` are generated `TokenLogprob`s or (token id, entry or None) for the prompt."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for item in entries:
            token_id, entry = ((item.token_id, item) if isinstance(item, TokenLogprob)
                               else item)
            token = self.token_text(token_id)
            out["tokens"].append(token)
            out["text_offset"].append(offset)
            offset += len(token)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(entry.logprob)
            # a prompt scored for prompt_logprobs may have more alternatives than asked here
            top = {self.token_text(t): lp for t, lp in entry.top[:self.request.logprobs]}
            top.setdefault(token, entry.logprob)
            out["top_logprobs"].append(top)
        return out


class ChatResponder(_Responder):
    """`/v1/chat/completions` responses; `tools` reads tool calls out of the text."""

    def __init__(self, tokenizer, model_name: str, body: ChatCompletionRequest,
                 runs: list[PromptRun], report_cached: bool = True,
                 tools: ToolOutput | None = None) -> None:
        super().__init__(tokenizer, model_name, body, runs, report_cached)
        self.object_name = "chat.completion.chunk" if body.stream else "chat.completion"
        self.tools = tools or ToolOutput("none")

    def response(self) -> dict:
        choices = []
        for state in self.runs[0].completions:
            reasoning, content, calls = self.tools.read(state.text)
            message = {"role": "assistant", "content": content}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            choices.append({
                "index": state.index, "message": message,
                "logprobs": self._logprobs(state.logprobs) if self.request.logprobs else None,
                "finish_reason": self.tools.finish_reason(state.finish_reason, bool(calls)),
                "stop_reason": state.stop_reason})
        return self.envelope(choices, usage=self.usage(), **self.prompt_logprobs(self.runs[0]))

    async def chunks(self, events: AsyncIterator[TextEvent]) -> AsyncIterator[dict]:
        choices: dict[int, ChoiceTools] = {}
        pending: dict[int, list] = {}
        async for event in events:
            if (error := self.error_chunk(event)) is not None:
                yield error
                continue
            index = event.state.index
            if index not in choices:  # OpenAI opens each choice with the role
                choices[index] = self.tools.choice()
                yield self.envelope([{"index": index, "delta": {"role": "assistant",
                                                                "content": ""},
                                      "logprobs": None, "finish_reason": None}],
                                    **self.prompt_logprobs(event.run))
            entries = pending.setdefault(index, [])
            entries += event.logprobs
            finish = event.state.finish_reason
            reasoning, content, calls = choices[index].feed(event.text)
            if finish is not None:
                more_reasoning, more_content, more_calls = choices[index].finish()
                reasoning, content, calls = (reasoning + more_reasoning, content + more_content,
                                             calls + more_calls)
            if not reasoning and not content and not calls and finish is None:
                continue
            pending[index] = []
            delta: dict = {"reasoning_content": reasoning} if reasoning else {}
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            yield self.envelope([{
                "index": index, "delta": delta,
                "logprobs": self._logprobs(entries) if self.request.logprobs else None,
                "finish_reason": self.tools.finish_reason(finish, choices[index].num_calls > 0),
                "stop_reason": event.state.stop_reason if finish else None}])
        if self.include_usage():
            yield self.envelope([], usage=self.usage())

    def _logprobs(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            token = self.token_text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [
            {**item(e.token_id, e.logprob),
             "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}
