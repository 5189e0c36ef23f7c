"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), served by
translation: a request becomes the chat completion request of the same conversation (so it
meets the same checks, limits, template and tool-call reading, and greedy text equals chat's),
and the chat's output is answered as Anthropic's content blocks, stop reasons and event
stream. Errors on these routes take Anthropic's shape (`error_body`)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, create_model

from braid.errors import UserError
from braid.server.chat_tools import BlockEvent, OutputBlocks, ToolOutput
from braid.server.generation import PromptRun, TextEvent
from braid.server.protocol import NonEmptyStr, OpenAIModel, RequestBody, RequestLimits
from braid.server.tool_calls import ToolCall

PATH_PREFIX = "/v1/messages"

# Anthropic's error type of each HTTP status (any other 4xx: invalid_request_error)
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error shape (it names no field: the message does)."""
    default = "api_error" if status >= 500 else "invalid_request_error"
    return {"type": "error",
            "error": {"type": _ERROR_TYPES.get(status, default), "message": message}}


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIModel):
    """A call the assistant made in an earlier turn."""

    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]


class ToolResultBlock(OpenAIModel):
    """What a call returned, sent back in the user's turn."""

    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        text = (self.content if isinstance(self.content, str)
                else "".join(block.text for block in self.content))
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(OpenAIModel):
    """An earlier turn's reasoning: not part of the prompt (as Anthropic drops it too)."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


class Message(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def chat_messages(self) -> list[dict]:
        """The message as chat messages: tool results become "tool" messages (before the
        turn's text, where Anthropic puts them), tool uses an assistant's `tool_calls`."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        texts, calls, results = [], [], []
        for block in self.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input,
                                                                ensure_ascii=False)}})
            elif isinstance(block, ToolResultBlock):
                results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": block.text()})
        messages = results
        if texts or calls or not results:
            message: dict = {"role": self.role, "content": "".join(texts) if texts or not calls
                             else None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
        return messages


class AnthropicTool(OpenAIModel):
    """A client tool: a function with its input's JSON schema (server tools, such as web
    search, have a `type` and no schema: refused)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(OpenAIModel):
    """Whether the model thinks (where its template can turn thinking on and off; braid does
    not bound the thinking's length: `budget_tokens` is accepted and has no effect)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class JsonOutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    """How the answer is shaped: `format` a JSON schema it follows (`effort` is for reasoning
    models' thinking, which braid does not run: accepted and without effect)."""

    format: JsonOutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(RequestBody):
    """`POST /v1/messages/count_tokens`: the prompt's tokens, tools included."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    # The chat request's fields that have other names here (for errors naming the field)
    chat_names: ClassVar[dict[str, str]] = {
        "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
        "response_format": "output_config"}

    @classmethod
    def publish(cls, schema: dict) -> None:
        super().publish(schema)
        if cls.served_model is not None:  # required here
            schema["properties"]["model"] = {"const": cls.served_model, "title": "Model"}

    @property
    def thinks(self) -> bool:
        """Whether the request asks for thinking."""
        return self.thinking is not None and self.thinking.type != "disabled"

    def chat_request(self) -> dict:
        """The fields of the chat completion request of the same conversation."""
        messages = []
        if self.system is not None:
            system = (self.system if isinstance(self.system, str)
                      else "".join(block.text for block in self.system))
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages += message.chat_messages()
        chat: dict = {"messages": messages}
        if self.thinking is not None:  # the switch of Qwen3's template, as vLLM passes it
            chat["chat_template_kwargs"] = {"enable_thinking": self.thinks}
        if self.tools:
            chat["tools"] = [{"type": "function", "function": {
                "name": tool.name, "description": tool.description,
                "parameters": tool.input_schema}} for tool in self.tools]
        output = self.output_config
        if output is not None and output.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": output.format.schema_}}
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool" and not choice.name:
                raise UserError("tool_choice of type tool needs the tool's `name`",
                                "tool_choice")
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type) or {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
        return chat


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[NonEmptyStr] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # a user id, for Anthropic's abuse detection

    def chat_request(self) -> dict:
        chat = super().chat_request()
        chat.update(max_completion_tokens=self.max_tokens, stream=self.stream)
        for name, value in (("stop", self.stop_sequences), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("top_k", self.top_k)):
            if value is not None:
                chat[name] = value
        return chat


def _tool_use(call: ToolCall, arguments: Any) -> dict:
    return {"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name,
            "input": arguments}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessagesResponder:
    """Messages API answers of one chat run: the message whole, or its event stream."""

    typed_events = True

    def __init__(self, model_name: str, run: PromptRun, tools: ToolOutput,
                 report_cached: bool) -> None:
        self.model_name, self.run, self.tools = model_name, run, tools
        self.report_cached = report_cached
        self.id = f"msg_{secrets.token_hex(12)}"

    def usage(self) -> dict:
        """Anthropic's usage: input tokens not read from the cache, and those read."""
        cached = self.run.num_cached_tokens if self.report_cached else 0
        return {"input_tokens": len(self.run.prompt_ids) - cached,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                "output_tokens": sum(len(s.token_ids) for s in self.run.completions)}

    def stop(self, called: bool) -> tuple[str | None, str | None]:
        """The stop reason and the stop sequence that ended the message."""
        state = self.run.completions[0]
        if state.finish_reason == "length":
            return "max_tokens", None
        if state.finish_reason != "stop":
            return None, None  # aborted (the server is stopping)
        if called:
            return "tool_use", None
        if isinstance(state.stop_reason, str):
            return "stop_sequence", state.stop_reason
        return "end_turn", None

    def message(self, content: list[dict], stop: tuple[str | None, str | None],
                usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.model_name, "content": content, "stop_reason": stop[0],
                "stop_sequence": stop[1], "usage": usage}

    def response(self) -> dict:
        reasoning, content, calls = self.tools.read(self.run.completions[0].text)
        blocks = [_thinking(reasoning)] if reasoning else []
        blocks += [{"type": "text", "text": content}] if content else []
        for call in calls:
            try:
                blocks.append(_tool_use(call, json.loads(call.arguments)))
            except json.JSONDecodeError:  # a named call cut short: its text, as it is
                blocks.append({"type": "text", "text": call.arguments})
        return self.message(blocks, self.stop(bool(calls)), self.usage())

    def stopped_event(self) -> dict:
        return error_body(503, "the engine stopped")

    async def chunks(self, events: AsyncIterator[TextEvent]) -> AsyncIterator[dict]:
        """message_start, each block's start, deltas and stop, message_delta (stop reason
        and usage), message_stop; an `error` event if generation fails."""
        usage = {**self.usage(), "output_tokens": 0}
        yield {"type": "message_start", "message": self.message([], (None, None), usage)}
        blocks = OutputBlocks(self.tools)
        async for event in events:
            state = event.state
            if state.finish_reason == "error":
                yield error_body(400 if state.invalid else 500,
                                 f"generation failed: {state.error}")
                return
            steps = blocks.feed(event.text)
            if state.finished:
                steps += blocks.finish()
            for step in steps:
                yield self._block_event(step)
        yield {"type": "message_delta",
               "delta": dict(zip(("stop_reason", "stop_sequence"),
                                 self.stop(blocks.num_calls > 0), strict=True)),
               "usage": self.usage()}
        yield {"type": "message_stop"}

    def _block_event(self, step: BlockEvent) -> dict:
        if step.kind == "stop":
            return {"type": "content_block_stop", "index": step.index}
        if step.kind == "start":
            if step.block == "reasoning":
                block = _thinking("")
            elif step.block == "text":
                block = {"type": "text", "text": ""}
            else:
                block = {"type": "tool_use", "id": _tool_use_id(step.call_id),
                         "name": step.name, "input": {}}
            return {"type": "content_block_start", "index": step.index, "content_block": block}
        if step.block == "reasoning":
            delta = {"type": "thinking_delta", "thinking": step.text}
        elif step.block == "text":
            delta = {"type": "text_delta", "text": step.text}
        else:
            delta = {"type": "input_json_delta", "partial_json": step.text}
        return {"type": "content_block_delta", "index": step.index, "delta": delta}


def _thinking(text: str) -> dict:
    """A thinking block (no signature: braid's reasoning is not signed)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def bounded_models(limits: RequestLimits, max_context: int, served_model: str
                   ) -> tuple[type[MessagesRequest], type[CountTokensRequest]]:
    """The Messages API's request models with `limits` and the model's context in their
    fields and schemas (as `protocol.bounded_models` makes OpenAI's)."""
    stop = Annotated[str, Field(min_length=1, max_length=limits.max_stop_string_chars)]
    messages = create_model(
        "MessagesRequest", __base__=MessagesRequest,
        max_tokens=(int, Field(ge=1, le=max_context)),
        messages=(Annotated[list[Message], Field(min_length=1, max_length=max_context)], ...),
        stop_sequences=(Annotated[list[stop], Field(max_length=limits.max_stop_strings)] | None,
                        None))
    count_tokens = create_model(
        "CountTokensRequest", __base__=CountTokensRequest,
        messages=(Annotated[list[Message], Field(min_length=1, max_length=max_context)], ...))
    for body in (messages, count_tokens):
        body.served_model = served_model
    return messages, count_tokens
