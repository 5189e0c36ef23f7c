"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
metrics, tokenize and detokenize.

Handlers tokenize, check a request completely before anything reaches the engine (a bad
request gets a 4xx in OpenAI's error shape, naming the field, and changes nothing), then turn
the engine's deltas into OpenAI responses or SSE streams. A client that disconnects aborts its
request.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from braid.config import ModelConfig, UserError
from braid.engine.core import check_request
from braid.engine.request import SamplingParams
from braid.server.async_engine import AsyncEngine, EngineDead
from braid.server.generation import PromptRun, generate, make_runs
from braid.server.metrics import Metrics
from braid.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from braid.server.responses import ChatResponder, CompletionResponder, sse

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
        response = CompletionResponder(ctx.tokenizer, ctx.model_name, body, runs, texts)
        if body.stream:
            return sse(response.chunks(generate(ctx.engine, runs, ctx.eos_token_ids,
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
        response = ChatResponder(ctx.tokenizer, ctx.model_name, body, runs)
        if body.stream:
            return sse(response.chunks(generate(ctx.engine, runs, ctx.eos_token_ids,
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
