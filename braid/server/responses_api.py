"""OpenAI's Responses API (`/v1/responses`), served by translation as Anthropic's Messages
are: a request becomes the chat completion request of its conversation (the instructions, the
stored conversation of `previous_response_id`, then its input items), and the chat's output
is answered as output items (a message, function calls) whole or as the API's typed events.
Stored responses (`store`, the API's default) live in a bounded in-memory `ResponseStore`."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, create_model

from braid.errors import UserError
from braid.server.chat_tools import BlockEvent, OutputBlocks, ToolOutput
from braid.server.generation import PromptRun, TextEvent
from braid.server.protocol import (
    JsonObjectFormat,
    NonEmptyStr,
    OpenAIModel,
    RequestBody,
    TextFormat,
)


class ResponseStore:
    """Stored responses by id, with the conversation each ends (its chat messages, the
    response's output last) for `previous_response_id`; the least recently used is evicted
    beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.capacity == 0:
            return
        self._entries[response["id"]] = (response, conversation)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


class ContentPart(OpenAIModel):
    """Text of a message item (images and files are refused: braid serves text models)."""

    type: Literal["input_text", "output_text"]
    text: str


def _content_text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(OpenAIModel):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    """What a call returned."""

    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[ContentPart]


class ReasoningItem(OpenAIModel):
    """An earlier turn's reasoning: not part of the prompt."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str:
    """An input item's type: a message may leave it out."""
    found = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return found or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type)]


class FunctionTool(OpenAIModel):
    """A function tool (hosted tools such as web search are refused by their type)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: NonEmptyStr


class JsonSchemaTextFormat(OpenAIModel):
    type: Literal["json_schema"]
    name: str = Field("response", max_length=256)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: Annotated[TextFormat | JsonObjectFormat | JsonSchemaTextFormat,
                      Field(discriminator="type")] | None = None


class ResponsesRequest(RequestBody):
    """`POST /v1/responses`."""

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None

    # The chat request's fields that have other names here (for errors naming the field)
    chat_names: ClassVar[dict[str, str]] = {
        "messages": "input", "max_completion_tokens": "max_output_tokens",
        "response_format": "text"}

    def conversation(self, store: ResponseStore) -> list[dict]:
        """The chat messages of the conversation so far, this request's input last (the
        instructions left out: they hold for this request only)."""
        messages: list[dict] = []
        if self.previous_response_id is not None:
            entry = store.get(self.previous_response_id)
            if entry is None:
                raise UserError(f"no stored response has the id {self.previous_response_id!r} "
                                "(never stored, deleted, or evicted)", "previous_response_id")
            messages = list(entry[1])
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _content_text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and not last.get(
                        "tool_call_id"):  # calls of one turn go in one assistant message
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None,
                                     "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": _content_text(item.output)})
        return messages

    def chat_request(self, conversation: list[dict]) -> dict:
        """The fields of the chat completion request of `conversation`."""
        system = ([{"role": "system", "content": self.instructions}]
                  if self.instructions is not None else [])
        chat: dict = {"messages": system + conversation, "stream": self.stream}
        for name, value in (("max_completion_tokens", self.max_output_tokens),
                            ("temperature", self.temperature), ("top_p", self.top_p),
                            ("parallel_tool_calls", self.parallel_tool_calls)):
            if value is not None:
                chat[name] = value
        if self.tools:
            chat["tools"] = [{"type": "function", "function": tool.model_dump(
                exclude={"type"}, exclude_none=True)} for tool in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            chat["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, JsonSchemaTextFormat):
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_}}
        elif isinstance(fmt, JsonObjectFormat):
            chat["response_format"] = {"type": "json_object"}
        return chat


def bounded_model(max_context: int, served_model: str) -> type[ResponsesRequest]:
    """The request model with the model's context in its fields and schema (as
    `protocol.bounded_models` makes OpenAI's other ones)."""
    model = create_model(
        "ResponsesRequest", __base__=ResponsesRequest,
        max_output_tokens=(Annotated[int, Field(ge=1, le=max_context)] | None, None),
        input=(str | Annotated[list[InputItem], Field(min_length=1, max_length=max_context)],
               ...))
    model.served_model = served_model
    return model


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ResponsesResponder:
    """Responses API answers of one chat run: the response whole, or its typed events. A
    finished response is stored (`store`) with the conversation it ends."""

    typed_events = True

    def __init__(self, model_name: str, body: ResponsesRequest, conversation: list[dict],
                 run: PromptRun, tools: ToolOutput, report_cached: bool,
                 store: Callable[[dict, list[dict]], None] | None) -> None:
        self.model_name, self.request, self.run, self.tools = model_name, body, run, tools
        self.conversation, self.report_cached, self.store = conversation, report_cached, store
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self._sequence = 0

    def envelope(self, status: str, output: list[dict], usage: dict | None = None,
                 error: dict | None = None) -> dict:
        """The response object in `status`."""
        body = self.request
        incomplete = ({"reason": "max_output_tokens"} if status == "incomplete" else None)
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model_name, "output": output, "error": error,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": (body.tool_choice.model_dump() if isinstance(
                body.tool_choice, FunctionChoice) else body.tool_choice or "auto"),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "text": {"format": (body.text.format.model_dump(by_alias=True) if body.text and
                                body.text.format else {"type": "text"})},
            "store": body.store, "truncation": "disabled", "usage": usage}

    def usage(self) -> dict:
        cached = self.run.num_cached_tokens if self.report_cached else 0
        prompt = len(self.run.prompt_ids)
        output = sum(len(s.token_ids) for s in self.run.completions)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output}

    def status(self) -> str:
        return "incomplete" if self.run.completions[0].finish_reason == "length" else "completed"

    def finished(self, output: list[dict]) -> dict:
        """The finished response; stored with its conversation if asked."""
        status = self.status()
        for item in output:
            item["status"] = status
        response = self.envelope(status, output, self.usage())
        if self.request.store and self.store is not None:
            self.store(response, self.conversation + [_assistant_message(output)])
        return response

    def response(self) -> dict:
        reasoning, content, calls = self.tools.read(self.run.completions[0].text)
        output = [_reasoning_item(_new_id("rs"), reasoning)] if reasoning else []
        output += [_message_item(_new_id("msg"), content)] if content else []
        output += [_call_item(_new_id("fc"), call.id, call.name, call.arguments)
                   for call in calls]
        return self.finished(output)

    def stopped_event(self) -> dict:
        return self._event("response.failed", response=self.envelope(
            "failed", [], error={"code": "server_error", "message": "the engine stopped"}))

    def _event(self, type_: str, **fields) -> dict:
        event = {"type": type_, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    async def chunks(self, events: AsyncIterator[TextEvent]) -> AsyncIterator[dict]:
        """response.created and .in_progress, each output item's events, then
        response.completed (or .incomplete; .failed if generation fails)."""
        yield self._event("response.created", response=self.envelope("in_progress", []))
        yield self._event("response.in_progress", response=self.envelope("in_progress", []))
        blocks = OutputBlocks(self.tools)
        output: list[dict] = []
        async for event in events:
            state = event.state
            if state.finish_reason == "error":
                code = "invalid_prompt" if state.invalid else "server_error"
                yield self._event("response.failed", response=self.envelope(
                    "failed", output, self.usage(),
                    {"code": code, "message": f"generation failed: {state.error}"}))
                return
            steps = blocks.feed(event.text)
            if state.finished:
                steps += blocks.finish()
            for step in steps:
                for item_event in self._item_events(step, output):
                    yield item_event
        response = self.finished(output)
        yield self._event(f"response.{response['status']}", response=response)

    def _item_events(self, step: BlockEvent, output: list[dict]) -> list[dict]:
        """The events of one step of the output blocks; `output` holds the items so far."""
        index = step.index
        if step.kind == "start":
            output.append(_new_item(step))
            item = output[index]
            item["status"] = "in_progress"
            added = _copy(item)
            if step.block == "text":  # its part comes in the next event
                added["content"] = []
            events = [self._event("response.output_item.added", output_index=index,
                                  item=added)]
            if step.block == "text":
                events.append(self._event("response.content_part.added", item_id=item["id"],
                                          output_index=index, content_index=0,
                                          part=dict(item["content"][0])))
            return events
        item = output[index]
        kind = {"reasoning": "reasoning_text", "text": "output_text"}.get(step.block)
        if step.kind == "delta" and kind is not None:
            item["content"][0]["text"] += step.text
            extra = {"logprobs": []} if step.block == "text" else {}
            return [self._event(f"response.{kind}.delta", item_id=item["id"],
                                output_index=index, content_index=0, delta=step.text,
                                **extra)]
        if step.kind == "delta":
            item["arguments"] += step.text
            return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=step.text)]
        item["status"] = self.status()
        if step.block == "reasoning":
            events = [self._event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=index, content_index=0,
                                  text=item["content"][0]["text"])]
        elif step.block == "text":
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=part["text"],
                                  logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0, part=dict(part))]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"],
                                  arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=_copy(item))]


def _new_item(step: BlockEvent) -> dict:
    """The empty output item that a block's start opens."""
    if step.block == "reasoning":
        return _reasoning_item(_new_id("rs"), "")
    if step.block == "text":
        return _message_item(_new_id("msg"), "")
    return _call_item(_new_id("fc"), step.call_id, step.name, "")


def _copy(item: dict) -> dict:
    """An item as it is now (the events' items must not change with later text)."""
    return {**item, "content": [dict(part) for part in item["content"]]} if (
        "content" in item) else dict(item)


def _message_item(item_id: str, text: str) -> dict:
    return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "status": "completed", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def _assistant_message(output: list[dict]) -> dict:
    """The chat message of a response's output, for the conversation it continues."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message
