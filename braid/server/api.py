"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
metrics, tokenize and detokenize.

Handlers tokenize, check a request completely before anything reaches the engine (a bad
request gets a 4xx in OpenAI's error shape, naming the field, and changes nothing), then turn
the engine's deltas into OpenAI responses or SSE streams. A client that disconnects aborts its
request.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from braid.config import ModelConfig, UserError
from braid.engine.core import check_request
from braid.engine.request import SamplingParams, TokenLogprob
from braid.server.async_engine import AsyncEngine, EngineDead
from braid.server.generation import PromptRun, TextEvent, generate, make_runs, usage
from braid.server.metrics import Metrics
from braid.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)

DISCONNECT_POLL_S = 0.5


@dataclass
class ServerContext:
    """What the handlers share."""

    engine: AsyncEngine
    tokenizer: object
    model_config: ModelConfig
    model_name: str
    model_path: str
    kv_capacity: int
    eos_token_ids: frozenset[int]
    metrics: Metrics
    api_key: str | None = None
    created: int = 0

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status)


def build_app(ctx: ServerContext) -> FastAPI:
    """The FastAPI application serving `ctx`'s model."""
    app = FastAPI(title="braid", docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    _install_error_handlers(app)

    def authorize(request: Request) -> None:
        if ctx.api_key is None:
            return
        supplied = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(supplied.encode(), ctx.api_key.encode()):
            raise APIError(401, "invalid API key: pass it as 'Authorization: Bearer KEY'",
                           type_="authentication_error", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != ctx.model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves "
                                f"`{ctx.model_name}`", "model", "not_found_error",
                           "model_not_found")

    @app.get("/health")
    async def health() -> Response:
        if ctx.engine.dead is not None:
            return JSONResponse(error_body(ctx.engine.dead, "server_error"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": ctx.created,
            "owned_by": "braid", "root": ctx.model_path, "max_model_len": ctx.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`", "prompt")
        if body.messages is not None:
            ids = _chat_prompt(ctx.tokenizer, body.messages)
        else:
            ids = ctx.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)
            ids = list(ids["input_ids"])
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        vocab = ctx.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in 0..{vocab - 1}", "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        prompts, texts = _completion_prompts(ctx.tokenizer, body.prompt)
        logprobs = body.logprobs
        params = body.sampling_params(body.max_tokens, logprobs,
                                      logprobs if body.echo and logprobs is not None else None)
        for ids in prompts:
            _check(ids, params, ctx, "prompt")
        runs = make_runs(f"cmpl-{secrets.token_hex(12)}", prompts, params, ctx.tokenizer)
        response = CompletionResponder(ctx, body, runs, texts)
        if body.stream:
            return _sse(response.chunks(generate(ctx.engine, runs, ctx.eos_token_ids,
                                                 ctx.metrics)))
        return await _complete(raw, runs, ctx, response.response)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        ids = _chat_prompt(ctx.tokenizer, body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # as much as the context and the cache leave
            max_tokens = max(1, min(ctx.max_model_len, ctx.kv_capacity) - len(ids))
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        params = body.sampling_params(max_tokens, (top or 0) if body.logprobs else None, None)
        _check(ids, params, ctx, "messages")
        runs = make_runs(f"chatcmpl-{secrets.token_hex(12)}", [ids], params, ctx.tokenizer)
        response = ChatResponder(ctx, body, runs)
        if body.stream:
            return _sse(response.chunks(generate(ctx.engine, runs, ctx.eos_token_ids,
                                                 ctx.metrics)))
        return await _complete(raw, runs, ctx, response.response)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(UserError)
    async def user_error(_: Request, e: UserError) -> JSONResponse:
        return APIError(400, str(e), e.param).response()

    @app.exception_handler(EngineDead)
    async def engine_dead(_: Request, e: EngineDead) -> JSONResponse:
        return APIError(503, f"the engine is not running: {e}", type_="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return APIError(400, f"malformed JSON body: {first.get('msg')}").response()
        fields = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = fields[0] if fields else None
        where = ".".join(fields) or "body"
        return APIError(400, f"{where}: {first.get('msg')}", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return APIError(e.status_code, str(e.detail),
                        type_="not_found_error" if e.status_code == 404 else
                        "invalid_request_error").response()


def _check(ids: list[int], params: SamplingParams, ctx: ServerContext, prompt_field: str) -> None:
    try:
        check_request(ids, params, ctx.model_config, ctx.kv_capacity)
    except UserError as e:
        raise APIError(400, str(e), prompt_field if e.param == "prompt" else e.param) from None


def _completion_prompts(tokenizer, prompt) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (a string, strings, token ids, lists of ids)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    prompts, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            prompts.append(list(tokenizer(p)["input_ids"]))
            texts.append(p)
        else:
            prompts.append(list(p))
            texts.append(None)
    return prompts, texts


def _chat_prompt(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """Token ids of a conversation through the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    conversation = []
    for message in messages:
        entry = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):  # content parts: the text ones, joined
            entry["content"] = "".join(part.get("text", "") for part in message.content
                                       if part.get("type") == "text")
        conversation.append(entry)
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                            tokenize=True)
    except Exception as e:  # noqa: BLE001 - a template's own complaint about the messages
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from e
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


async def _complete(raw: Request, runs: list[PromptRun], ctx: ServerContext,
                    respond) -> Response:
    """Run a non-streamed request to the end, aborting it if the client goes away."""

    async def drain() -> None:
        async for _ in generate(ctx.engine, runs, ctx.eos_token_ids, ctx.metrics):
            pass

    task = asyncio.ensure_future(drain())
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            task.result()
            break
        if await raw.is_disconnected():
            task.cancel()  # the generator's cleanup aborts the request
            return Response(status_code=499)
    failed = [s.error for run in runs for s in run.states if s.finish_reason == "error"]
    if failed:
        raise APIError(500, f"generation failed: {failed[0]}", type_="server_error")
    return JSONResponse(respond())


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events in OpenAI's format, ending with `data: [DONE]`."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except EngineDead as e:
            yield f"data: {json.dumps(error_body(f'the engine stopped: {e}', 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


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

    def __init__(self, ctx: ServerContext, body, runs: list[PromptRun]) -> None:
        self.ctx, self.request, self.runs = ctx, body, runs
        self.id = runs[0].request_id.rsplit("-", 1)[0]
        self.created = int(time.time())
        self.token_text = TokenText(ctx.tokenizer)

    def envelope(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.ctx.model_name, "choices": choices, **extra}

    def include_usage(self) -> bool:
        return bool(self.request.stream_options and self.request.stream_options.include_usage)

    def error_chunk(self, event: TextEvent) -> dict | None:
        if event.state.finish_reason == "error":
            return error_body(f"generation failed: {event.state.error}", "server_error")
        return None


class CompletionResponder(_Responder):
    """`/v1/completions` responses: choices indexed prompt * n + completion."""

    object_name = "text_completion"

    def __init__(self, ctx: ServerContext, body: CompletionRequest, runs: list[PromptRun],
                 texts: list[str | None]) -> None:
        super().__init__(ctx, body, runs)
        self.prompt_texts = [t if t is not None else ctx.tokenizer.decode(run.prompt_ids)
                             for t, run in zip(texts, runs)]

    def choice_index(self, prompt_index: int, state) -> int:
        return prompt_index * self.request.n + state.index

    def response(self) -> dict:
        choices = []
        for i, run in enumerate(self.runs):
            for state in run.states:
                text = (self.prompt_texts[i] if self.request.echo else "") + state.text
                logprobs = None
                if self.request.logprobs is not None:
                    entries = self._prompt_entries(run) + list(state.logprobs)
                    logprobs = self._logprobs(entries, 0)
                choices.append({"index": self.choice_index(i, state), "text": text,
                                "logprobs": logprobs, "finish_reason": state.finish_reason,
                                "stop_reason": state.stop_reason})
        return self.envelope(choices, usage=usage(self.runs))

    async def chunks(self, events: AsyncIterator[TextEvent]) -> AsyncIterator[dict]:
        offsets: dict[int, int] = {}
        pending: dict[int, list] = {}  # logprobs of tokens whose text is held back
        async for event in events:
            if (error := self.error_chunk(event)) is not None:
                yield error
                continue
            index = self.choice_index(event.prompt_index, event.state)
            text = event.text
            entries = pending.setdefault(index, [])
            if index not in offsets:  # the first chunk of a choice carries the echo
                offsets[index] = 0
                if self.request.echo:
                    text = self.prompt_texts[event.prompt_index] + text
                    entries += self._prompt_entries(event.run)
            entries += event.logprobs
            finish = event.state.finish_reason
            if not text and finish is None:
                continue
            logprobs = None
            if self.request.logprobs is not None:
                logprobs = self._logprobs(entries, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs["tokens"])
            pending[index] = []
            yield self.envelope([{"index": index, "text": text, "logprobs": logprobs,
                                  "finish_reason": finish,
                                  "stop_reason": event.state.stop_reason if finish else None}])
        if self.include_usage():
            yield self.envelope([], usage=usage(self.runs))

    def _prompt_entries(self, run: PromptRun) -> list:
        """Echo: (token id, entry) of every prompt token; the first has no logprob."""
        if not self.request.echo:
            return []
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
            top = {self.token_text(t): lp for t, lp in entry.top}
            top.setdefault(token, entry.logprob)
            out["top_logprobs"].append(top)
        return out


class ChatResponder(_Responder):
    """`/v1/chat/completions` responses."""

    object_name = "chat.completion"

    def response(self) -> dict:
        choices = []
        for state in self.runs[0].states:
            choices.append({
                "index": state.index,
                "message": {"role": "assistant", "content": state.text},
                "logprobs": self._logprobs(state.logprobs) if self.request.logprobs else None,
                "finish_reason": state.finish_reason, "stop_reason": state.stop_reason})
        return self.envelope(choices, usage=usage(self.runs))

    async def chunks(self, events: AsyncIterator[TextEvent]) -> AsyncIterator[dict]:
        self.object_name = "chat.completion.chunk"
        started: set[int] = set()
        pending: dict[int, list] = {}
        async for event in events:
            if (error := self.error_chunk(event)) is not None:
                yield error
                continue
            index = event.state.index
            if index not in started:  # OpenAI opens each choice with the role
                started.add(index)
                yield self.envelope([{"index": index, "delta": {"role": "assistant",
                                                                "content": ""},
                                      "logprobs": None, "finish_reason": None}])
            entries = pending.setdefault(index, [])
            entries += event.logprobs
            finish = event.state.finish_reason
            if not event.text and finish is None:
                continue
            pending[index] = []
            delta = {"content": event.text} if event.text else {}
            yield self.envelope([{
                "index": index, "delta": delta,
                "logprobs": self._logprobs(entries) if self.request.logprobs else None,
                "finish_reason": finish,
                "stop_reason": event.state.stop_reason if finish else None}])
        if self.include_usage():
            yield self.envelope([], usage=usage(self.runs))

    def _logprobs(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            token = self.token_text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [
            {**item(e.token_id, e.logprob),
             "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}
