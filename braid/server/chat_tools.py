"""How a chat choice's text becomes its assistant message: first the reasoning is split off
where the server has a reasoning parser, then the answer is read for the tools the request
offers: plain content (`tool_choice` "none", or no tools), the arguments of the one function a
request named, the JSON array of calls that "required" constrains the output to, or whatever
the model's tool-call parser finds ("auto"). Streamed, each choice has a `ChoiceTools` turning
text pieces into reasoning, `delta.content` and `delta.tool_calls` entries (OpenAI's shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from braid.server.reasoning import ThinkParser
from braid.server.tool_calls import (
    ToolCall,
    ToolCallParser,
    calls_from_required_output,
    new_call_id,
)


class ToolOutput:
    """A chat request's rule for reading its choices' text (`ChatCompletionRequest.tool_mode`
    and, for "auto", the server's parser; "named": `function` is the forced one; `single`:
    `parallel_tool_calls` false, so "auto" keeps the first call only; `reasoning`: the
    server's reasoning parser, where the output may reason, and `in_reasoning` whether the
    prompt leaves the output inside the reasoning)."""

    def __init__(self, mode: str, parser: ToolCallParser | None = None,
                 function: str | None = None, single: bool = False,
                 reasoning: ThinkParser | None = None, in_reasoning: bool = False) -> None:
        self.mode, self.parser, self.function, self.single = mode, parser, function, single
        self.reasoning, self.in_reasoning = reasoning, in_reasoning

    def read(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """The whole text's reasoning (None without), content and tool calls."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text, self.in_reasoning)
        return reasoning, *self.message(text)

    def message(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content and tool calls."""
        if self.mode == "named":
            return None, [ToolCall(new_call_id(), self.function, text)]
        if self.mode == "required":  # text that is not the array (cut short) is content
            calls = calls_from_required_output(text)
            return (None, calls) if calls else (text, [])
        if self.mode == "auto" and self.parser is not None:
            content, calls = self.parser.parse(text)
            return content, calls[:1] if self.single else calls
        return text, []

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's "tool_calls" for a choice that ended in calls it chose to make (a named
        function's call ends with "stop", as OpenAI's does)."""
        return "tool_calls" if called and reason == "stop" and self.mode != "named" else reason

    def choice(self) -> ChoiceTools:
        """A streamed choice's reader."""
        return ChoiceTools(self)


class ChoiceTools:
    """One streamed choice: text pieces in; reasoning, content and tool_calls delta entries
    out."""

    def __init__(self, output: ToolOutput) -> None:
        self.output = output
        self._reasoning = (output.reasoning.stream(output.in_reasoning)
                           if output.reasoning is not None else None)
        self.num_calls = 0
        self._call_id: str | None = None  # "named": the call whose arguments are streaming
        self._text: list[str] = []  # "required": the array, read whole at the end
        self._stream = (output.parser.stream() if output.mode == "auto" and output.parser
                        else None)

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        """A piece of the choice's text: the reasoning and content to emit now and
        `delta.tool_calls` entries."""
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text)
        return reasoning, *self._feed_answer(text)

    def finish(self) -> tuple[str, str, list[dict]]:
        """What the end of the choice's text releases."""
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.finish()
            content, entries = self._feed_answer(text)
        else:
            content, entries = "", []
        more_content, more_entries = self._finish_answer()
        return reasoning, content + more_content, entries + more_entries

    def _feed_answer(self, text: str) -> tuple[str, list[dict]]:
        mode = self.output.mode
        if mode == "named":  # the arguments stream as they are generated
            if not text:
                return "", []
            if self._call_id is None:
                self._call_id = new_call_id()
                self.num_calls = 1
                return "", [{"index": 0, "id": self._call_id, "type": "function",
                             "function": {"name": self.output.function, "arguments": text}}]
            return "", [{"index": 0, "function": {"arguments": text}}]
        if mode == "required":
            self._text.append(text)
            return "", []
        if self._stream is not None:
            content, calls = self._stream.feed(text)
            return content, self._entries(calls)
        return text, []

    def _finish_answer(self) -> tuple[str, list[dict]]:
        if self.output.mode == "required":
            content, calls = self.output.message("".join(self._text))
            return content or "", self._entries(calls)
        if self._stream is not None:
            content, calls = self._stream.finish()
            return content, self._entries(calls)
        return "", []

    def _entries(self, calls: list[ToolCall]) -> list[dict]:
        entries = []
        if self.output.single:
            calls = calls[:max(0, 1 - self.num_calls)]
        for call in calls:
            entries.append({"index": self.num_calls, **call.to_openai()})
            self.num_calls += 1
        return entries


@dataclass(frozen=True)
class BlockEvent:
    """A step of a streamed choice seen as output blocks: a block of reasoning, of answer text
    or a function call opens ("start"), grows ("delta": text, or the call's arguments) and
    closes ("stop")."""

    kind: Literal["start", "delta", "stop"]
    block: Literal["reasoning", "text", "call"]
    index: int  # the block's position in the choice's output
    text: str = ""
    call_id: str | None = None  # a call's start: its id and function
    name: str | None = None


class OutputBlocks:
    """A streamed choice as a sequence of blocks, each opened, extended and closed in turn:
    the shape of Anthropic's content blocks and of the Responses API's output items (OpenAI's
    chat deltas instead interleave content and calls)."""

    def __init__(self, output: ToolOutput) -> None:
        self._choice = output.choice()
        self.count = 0  # blocks opened
        self._open: str | None = None  # the kind of the open block

    @property
    def num_calls(self) -> int:
        return self._choice.num_calls

    def feed(self, text: str) -> list[BlockEvent]:
        """The events of a piece of the choice's text."""
        return self._events(*self._choice.feed(text))

    def finish(self) -> list[BlockEvent]:
        """The events the end of the text releases, the last block's stop among them."""
        return self._events(*self._choice.finish()) + self._close()

    def _events(self, reasoning: str, content: str, entries: list[dict]) -> list[BlockEvent]:
        events = []
        for block, text in (("reasoning", reasoning), ("text", content)):
            if text:
                if self._open != block:
                    events += self._close() + [self._start(block)]
                events.append(BlockEvent("delta", block, self.count - 1, text))
        for entry in entries:
            function = entry["function"]
            if "id" in entry:  # a new call; without an id, more arguments of the open one
                events += self._close() + [self._start("call", entry["id"], function["name"])]
            if function.get("arguments"):
                events.append(BlockEvent("delta", "call", self.count - 1,
                                         function["arguments"]))
        return events

    def _start(self, block: str, call_id: str | None = None,
               name: str | None = None) -> BlockEvent:
        self._open = block
        self.count += 1
        return BlockEvent("start", block, self.count - 1, call_id=call_id, name=name)

    def _close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("stop", block, self.count - 1)]
