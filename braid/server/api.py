"""The HTTP API (FastAPI): OpenAI's completions, chat completions, Responses and embeddings,
Anthropic's Messages, models, health, metrics, tokenize and detokenize.

Before a handler runs, middleware checks the API key from the headers and bounds the body's
size. Handlers tokenize, check a request completely before anything reaches the engine (a bad
request gets a 4xx in OpenAI's error shape, naming the field, and changes nothing; a full queue
a 429 with Retry-After), then turn the engine's deltas into OpenAI responses or SSE streams. A
client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from braid.engine.request import SamplingParams, check_request
from braid.errors import UserError
from braid.loader.model_config import ModelConfig
from braid.server import anthropic, embeddings, responses_api
from braid.server.anthropic import CountTokensRequest, MessagesRequest, MessagesResponder
from braid.server.api_errors import APIError, install_error_handlers, invalid_body, named_as
from braid.server.async_engine import AsyncEngine, EngineDead
from braid.server.chat_tools import ToolOutput
from braid.server.embeddings import EmbeddingRequest, EmbeddingResponder
from braid.server.generation import PromptRun, close, generate, make_runs, submit
from braid.server.metrics import Metrics
from braid.server.middleware import LimitBody, RequireAPIKey
from braid.server.prompts import chat_prompt, completion_prompts, tokenize_text
from braid.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestLimits,
    TokenizeRequest,
    bounded_models,
    error_body,
    unsupported_field,
)
from braid.server.reasoning import ThinkParser
from braid.server.responses import ChatResponder, CompletionResponder, sse
from braid.server.responses_api import ResponsesRequest, ResponsesResponder, ResponseStore
from braid.server.tool_calls import ToolCallParser

DISCONNECT_POLL_S = 0.5
PROMPT_TAIL_TOKENS = 16  # where a prompt may have opened a think block
OPEN_PATHS = frozenset({"/health", "/metrics"})  # no key needed, unless --api-key-all-routes
RETRY_AFTER_S = 1  # a full queue drains at the engine's pace: ask again soon


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
    api_key_all_routes: bool = False  # the key on /health and /metrics too
    limits: RequestLimits = field(default_factory=RequestLimits)
    report_cached_tokens: bool = True  # usage.prompt_tokens_details.cached_tokens
    tool_parser: ToolCallParser | None = None  # reads tool_choice "auto" outputs
    reasoning_parser: ThinkParser | None = None  # splits reasoning from the answer
    response_store: ResponseStore = field(default_factory=lambda: ResponseStore(256))
    pooling: str = "last"  # how /v1/embeddings pools a prompt's final hidden states
    matryoshka_dimensions: list[int] | bool = False  # shorter lengths vectors may take
    created: int = 0

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings


def build_app(ctx: ServerContext) -> FastAPI:
    """The FastAPI application serving `ctx`'s model."""
    app = FastAPI(title="braid", docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app, ctx.metrics)
    reject = ctx.metrics.reject
    app.add_middleware(LimitBody, max_bytes=ctx.limits.max_request_bytes, on_reject=reject)
    if ctx.api_key is not None:  # outermost: nothing of a request is read before the key
        app.add_middleware(RequireAPIKey, api_key=ctx.api_key, on_reject=reject,
                           open_paths=frozenset() if ctx.api_key_all_routes else OPEN_PATHS)
    models = bounded_models(ctx.limits, ctx.model_config.vocab_size, ctx.max_model_len,
                            ctx.model_name, auto_tool_calls=ctx.tool_parser is not None)
    messages_model, count_tokens_model = anthropic.bounded_models(
        ctx.limits, ctx.max_model_len, ctx.model_name)
    responses_model = responses_api.bounded_model(ctx.max_model_len, ctx.model_name)
    embedding_model = embeddings.bounded_model(ctx.limits, ctx.model_config.vocab_size,
                                               ctx.max_model_len, ctx.model_name)

    def post(path: str, body_model: type) -> Callable:
        """`app.post`, with the handler's `body` typed by this server's bounded model (a
        class made at run time, which a string annotation cannot name)."""
        def register(handler):
            handler.__annotations__["body"] = body_model
            return app.post(path)(handler)
        return register

    def check_model(name: str | None) -> None:
        if name is not None and name != ctx.model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves "
                                f"`{ctx.model_name}`", "model", "not_found_error",
                           "model_not_found")

    def check_fields(body) -> None:
        check_model(body.model)
        name = unsupported_field(body)
        if name is not None:
            raise APIError(400, f"`{name}` is not supported by braid: leave it out", name,
                           code="unsupported_field")

    def check_capacity(count: int) -> None:
        """Before any work on a request of `count` completions: 400 beyond what one request
        may ask for, 429 if the queue has no room for them. Nothing awaits between this and
        the request's `submit`, so no other request can take the room meanwhile."""
        if ctx.engine.dead is not None:
            raise EngineDead(ctx.engine.dead)
        limit = ctx.limits.max_sequences_per_request
        if count > limit:
            raise APIError(400, f"the request asks for {count} completions (prompts x n); "
                                f"this server allows {limit} (--max-sequences-per-request)",
                           "n")
        limit = ctx.limits.max_queued_sequences
        if ctx.engine.queued_sequences + count > limit:
            reject("queue_full")
            raise APIError(429, f"the server's queue is full ({limit} sequences waiting, "
                                "--max-queued-sequences): retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    async def run(runs: list[PromptRun], stream: bool, response, raw: Request) -> Response:
        """Queue the runs and answer with their stream or, once they are done, their
        response."""
        deltas = submit(ctx.engine, runs, ctx.eos_token_ids, ctx.metrics)
        events = generate(ctx.engine, runs, deltas, ctx.metrics)
        if stream:
            return sse(response.chunks(events), on_close=lambda: close(ctx.engine, runs),
                       typed=response.typed_events, stopped=response.stopped_event)
        try:
            return await _complete(raw, runs, events, response.response)
        finally:
            close(ctx.engine, runs)

    @app.get("/health")
    async def health() -> Response:
        if ctx.engine.dead is not None:  # why is in the server's log, not for any client
            return JSONResponse(error_body("the engine is not running", "server_error"),
                                status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models_list() -> dict:
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": ctx.created,
            "owned_by": "braid", "root": ctx.model_path, "max_model_len": ctx.max_model_len}]}

    @post("/tokenize", models.tokenize)
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`", "prompt")
        if body.messages is not None:
            ids = chat_prompt(ctx.tokenizer, body.messages, None, body.chat_template_kwargs)
        else:
            ids = tokenize_text(ctx.tokenizer, body.prompt, "prompt", body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}

    @post("/detokenize", models.detokenize)
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @post("/v1/completions", models.completion)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_fields(body)
        n_prompts = 1 if isinstance(body.prompt, str) or _is_ids(body.prompt) else len(
            body.prompt)
        check_capacity(n_prompts * body.n)
        prompts, texts = completion_prompts(ctx.tokenizer, body.prompt)
        max_tokens = body.max_tokens or _room(ctx, max(len(p) for p in prompts))
        logprobs = body.logprobs
        params = body.sampling_params(max_tokens, logprobs,
                                      logprobs if body.echo and logprobs is not None else None)
        for ids in prompts:
            _check(ids, params, ctx, "prompt")
        runs = make_runs(f"cmpl-{secrets.token_hex(12)}", prompts, params, ctx.tokenizer)
        response = CompletionResponder(ctx.tokenizer, ctx.model_name, body, runs, texts,
                                       ctx.report_cached_tokens)
        return await run(runs, body.stream, response, raw)

    def chat_runs(body: ChatCompletionRequest, prefix: str) -> tuple[list[PromptRun],
                                                                       ToolOutput]:
        """A checked chat request's run (ids `{prefix}-...`) and how its text is read."""
        check_fields(body)
        check_capacity(body.n)
        ids = chat_prompt(ctx.tokenizer, body.messages,
                          body.tool_dicts() if body.tool_mode != "none" else None,
                          body.chat_template_kwargs)
        max_tokens = body.max_completion_tokens or body.max_tokens or _room(ctx, len(ids))
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        params = body.sampling_params(max_tokens, (top or 0) if body.logprobs else None, None)
        parser, in_reasoning = ctx.reasoning_parser, False
        if parser is not None:
            # A constraint on the answer lets the reasoning before it be free
            state = parser.prompt_state(ctx.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]))
            in_reasoning = state == "inside"
            structured = params.structured
            if structured is not None and structured.describes_answer and state != "closed":
                params = replace(params, structured=replace(
                    structured, reasoning="inside" if in_reasoning else "opens"))
        _check(ids, params, ctx, "messages")
        tools = _tool_output(body, ctx.tool_parser, parser, in_reasoning)
        return make_runs(f"{prefix}-{secrets.token_hex(12)}", [ids], params,
                         ctx.tokenizer), tools

    def as_chat(body, *args) -> ChatCompletionRequest:
        """The chat completion request of another API's request (`body.chat_request(*args)`),
        checked like any chat request."""
        try:
            return models.chat.model_validate({**body.chat_request(*args),
                                               "model": body.model})
        except ValidationError as e:
            raise invalid_body(e.errors()) from None

    @post("/v1/messages", messages_model)
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        if body.thinks and ctx.reasoning_parser is None:
            raise APIError(400, "thinking needs a reasoning model: this server reads no "
                                "reasoning from its output (--reasoning-parser)", "thinking")
        with named_as(body.chat_names):
            runs, tools = chat_runs(as_chat(body), "msg")
        response = MessagesResponder(ctx.model_name, runs[0], tools, ctx.report_cached_tokens)
        return await run(runs, body.stream, response, raw)

    @post("/v1/messages/count_tokens", count_tokens_model)
    async def count_tokens(body: CountTokensRequest) -> dict:
        with named_as(body.chat_names):
            chat = as_chat(body)
            check_fields(chat)
            ids = chat_prompt(ctx.tokenizer, chat.messages,
                              chat.tool_dicts() if chat.tool_mode != "none" else None,
                              chat.chat_template_kwargs)
        return {"input_tokens": len(ids)}

    @post("/v1/responses", responses_model)
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        with named_as(body.chat_names):
            conversation = body.conversation(ctx.response_store)
            runs, tools = chat_runs(as_chat(body, conversation), "resp")
        response = ResponsesResponder(ctx.model_name, body, conversation, runs[0], tools,
                                      ctx.report_cached_tokens, ctx.response_store.put)
        return await run(runs, body.stream, response, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        entry = ctx.response_store.get(response_id)
        if entry is None:
            raise _no_response(response_id)
        return entry[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        if not ctx.response_store.delete(response_id):
            raise _no_response(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @post("/v1/embeddings", embedding_model)
    async def create_embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        check_model(body.model)
        inputs = body.input
        check_capacity(1 if isinstance(inputs, str) or _is_ids(inputs) else len(inputs))
        with named_as({"prompt": "input"}):
            prompts, _ = completion_prompts(ctx.tokenizer, inputs)
        if body.dimensions is not None:
            _check_dimensions(body.dimensions, ctx.model_config.hidden_size,
                              ctx.matryoshka_dimensions)
        params = SamplingParams(max_new_tokens=1, pooling=ctx.pooling)
        for ids in prompts:
            _check(ids, params, ctx, "input")
        runs = make_runs(f"embd-{secrets.token_hex(12)}", prompts, params, ctx.tokenizer)
        return await run(runs, False, EmbeddingResponder(ctx.model_name, body, runs), raw)

    @post("/v1/chat/completions", models.chat)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        runs, tools = chat_runs(body, "chatcmpl")
        response = ChatResponder(ctx.tokenizer, ctx.model_name, body, runs,
                                 ctx.report_cached_tokens, tools)
        return await run(runs, body.stream, response, raw)

    return app


def _room(ctx: ServerContext, prompt_len: int) -> int:
    """New tokens a prompt leaves room for (`max_tokens` absent or null)."""
    return max(1, min(ctx.max_model_len, ctx.kv_capacity) - prompt_len)


def _is_ids(prompt) -> bool:
    return bool(prompt) and all(isinstance(p, int) for p in prompt)


def _no_response(response_id: str) -> APIError:
    return APIError(404, f"no stored response has the id {response_id!r} (never stored, "
                         "deleted, or evicted)", "response_id", "not_found_error")


def _check(ids: list[int], params: SamplingParams, ctx: ServerContext, prompt_field: str) -> None:
    try:
        check_request(ids, params, ctx.model_config, ctx.kv_capacity)
    except UserError as e:
        raise APIError(400, str(e), prompt_field if e.param == "prompt" else e.param) from None


def _check_dimensions(dimensions: int, size: int, allowed: list[int] | bool) -> None:
    """400 for an embedding length the model's vectors do not keep their meaning at."""
    if dimensions == size:
        return
    if dimensions > size:
        reason = f"at most {size}, this model's"
    elif not allowed:
        reason = (f"{size}: this model was not trained for shorter vectors (its config has no "
                  "matryoshka_dimensions or is_matryoshka)")
    elif allowed is not True and dimensions not in allowed:
        reason = f"one of {sorted(allowed)} (its matryoshka_dimensions)"
    else:
        return
    raise APIError(400, f"dimensions must be {reason}", "dimensions")


def _tool_output(body: ChatCompletionRequest, parser: ToolCallParser | None,
                 reasoning: ThinkParser | None, in_reasoning: bool) -> ToolOutput:
    """How the request's choices are read (400 for "auto" tool calls without a parser)."""
    mode = body.tool_mode
    if mode == "auto" and parser is None:
        raise APIError(400, "tool_choice auto needs a tool-call parser, and this model's chat "
                            "template has no known tool-call format: start the server with "
                            "--tool-call-parser (and --chat-template), or send tool_choice "
                            "required, none or a named function", "tool_choice")
    name = body.tool_choice.function.name if mode == "named" else None
    return ToolOutput(mode, parser, name, single=body.parallel_tool_calls is False,
                      reasoning=reasoning, in_reasoning=in_reasoning)


def _log_abandoned(runs: list[PromptRun]) -> None:
    """Say in the server's log how far a request had got when its client went away (a client's
    timeout on a long generation reads as a stall without it)."""
    completions = [c for run in runs for c in run.completions]
    generated = sum(len(c.token_ids) for c in completions)
    asked = len(completions) * runs[0].params.max_new_tokens
    logging.getLogger("uvicorn.error").info(
        "%s: the client went away after %.1f s, with %d of at most %d tokens generated "
        "(%d completions); aborted", runs[0].group, time.monotonic() - runs[0].arrival,
        generated, asked, len(completions))


async def _complete(raw: Request, runs: list[PromptRun], events, respond) -> Response:
    """Run a non-streamed request to the end, aborting it if the client goes away."""

    async def drain() -> None:
        async for event in events:
            if event.state.finish_reason == "error":
                return  # the answer is an error: the caller aborts the other completions

    task = asyncio.ensure_future(drain())
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            task.result()
            break
        if await raw.is_disconnected():
            task.cancel()  # the caller aborts the request
            _log_abandoned(runs)
            return Response(status_code=499)
    failed = [s for run in runs for s in run.completions if s.finish_reason == "error"]
    if failed and all(s.invalid for s in failed):  # what the request asks cannot be generated
        raise APIError(400, f"generation failed: {failed[0].error}", failed[0].param)
    if failed:
        raise APIError(500, f"generation failed: {failed[0].error}", type_="server_error")
    return JSONResponse(respond())
