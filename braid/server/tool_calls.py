"""OpenAI chat `tools` support: parsers that find tool calls in a model's text, whole or
streamed, in the format of its family (hermes, llama3_json, deepseek_v3), and the JSON schemas
that constrain the output for `tool_choice` naming a function or "required".

A parser's `parse` is its stream fed the whole text at once, so a streamed answer and a
non-streamed one agree by construction; the tests check that any split of the text does too.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One function call found in the output; `arguments` is a JSON text of an object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The call as an entry of an OpenAI message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    """A fresh id in OpenAI's shape: `call_` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _json_object(text: str) -> dict | None:
    """`text` parsed as a JSON object, or None when it is not one (model output never raises)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _make_call(name: object, arguments: object) -> ToolCall | None:
    """A call from a parsed name and arguments object (a JSON text of one is also accepted),
    or None when either is malformed. Arguments are re-serialized so that every format gives
    the same compact text."""
    if isinstance(arguments, str):
        arguments = _json_object(arguments)
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def _call_from_json(obj: object) -> ToolCall | None:
    """A call from `{"name": ..., "arguments" | "parameters": {...}}`; no arguments means {}."""
    if not isinstance(obj, dict):
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    return _make_call(obj.get("name"), {} if arguments is None else arguments)


class ToolCallStream(ABC):
    """One generation's output, fed as it is decoded."""

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Content safe to show now (text that may still begin a call is held back) and the
        calls this delta completed."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]:
        """The held-back content and calls at the end of generation: an unterminated call
        that parses is a call, otherwise its text is content."""


class ToolCallParser(ABC):
    """Finds tool calls in the text of one model family."""

    name: ClassVar[str]

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A parser state for one streamed generation."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message content (None when blank and there are calls) and the calls."""
        stream = self.stream()
        content, calls = stream.feed(text)
        tail, more = stream.finish()
        content, calls = content + tail, calls + more
        return (None if calls and not content.strip() else content), calls


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a marker begins with (a partial match)."""
    for size in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in markers):
            return size
    return 0


class MarkerParser(ToolCallParser):
    """A format whose calls are blocks between `start` and `end` markers. `silent` markers
    (wrappers around a group of calls) are dropped from the content."""

    start: ClassVar[str]
    end: ClassVar[str]
    silent: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def call_from_block(self, block: str) -> ToolCall | None:
        """The call written between the markers, or None when it does not parse."""

    def stream(self) -> ToolCallStream:
        """A parser state for one streamed generation."""
        return _MarkerStream(self)


class _MarkerStream(ToolCallStream):
    """Content flows out as it comes, call blocks are held until their end marker. Blank
    content next to calls (the newline between two blocks) is held until text that is not
    blank follows, and dropped if a call follows instead, so that it never reaches the client
    as content of its own."""

    def __init__(self, parser: MarkerParser) -> None:
        self._parser = parser
        self._markers = (parser.start, *parser.silent)
        self._buffer = ""  # undecided text: a partial marker, or the inside of an open block
        self._in_call = False
        self._blank = ""  # blank content since the start or the last call
        self._flowing = False  # the content since the start or the last call is not blank
        self._any_call = False

    def _content(self, text: str) -> str:
        if self._flowing:
            return text
        self._blank += text
        if not self._blank.strip():
            return ""
        self._flowing = True
        text, self._blank = self._blank, ""
        return text

    def _close(self, block: str, calls: list[ToolCall], closed: bool) -> str:
        self._in_call = False
        call = self._parser.call_from_block(block)
        if call is None:
            end = self._parser.end if closed else ""
            return self._content(self._parser.start + block + end)
        calls.append(call)
        self._blank, self._flowing, self._any_call = "", False, True
        return ""

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """See `ToolCallStream.feed`."""
        self._buffer += delta
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                at = self._buffer.find(self._parser.end)
                if at < 0:
                    break
                out.append(self._close(self._buffer[:at], calls, closed=True))
                self._buffer = self._buffer[at + len(self._parser.end) :]
                continue
            found = [(at, m) for m in self._markers if (at := self._buffer.find(m)) >= 0]
            if not found:
                keep = len(self._buffer) - held_suffix(self._buffer, self._markers)
                out.append(self._content(self._buffer[:keep]))
                self._buffer = self._buffer[keep:]
                break
            at, marker = min(found)
            out.append(self._content(self._buffer[:at]))
            self._buffer = self._buffer[at + len(marker) :]
            self._in_call = marker == self._parser.start
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """See `ToolCallStream.finish`."""
        calls: list[ToolCall] = []
        if self._in_call:
            text = self._close(self._buffer, calls, closed=False)
        else:
            text = self._content(self._buffer)
        self._buffer = ""
        if not self._flowing and not self._any_call:
            text += self._blank  # a blank answer without calls is still the answer
        return text, calls


class HermesParser(MarkerParser):
    """Hermes, Qwen2.5 and Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    one block per call."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def call_from_block(self, block: str) -> ToolCall | None:
        """The call in one block's JSON object."""
        return _call_from_json(_json_object(block))


# DeepSeek-V3's markers, spelled with U+FF5C (full-width bar) and U+2581 as in its tokenizer.
_DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_DS_CALLS_END = "<｜tool▁calls▁end｜>"
_DS_SEP = "<｜tool▁sep｜>"
_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*(?:```)?", re.DOTALL)


class DeepSeekV3Parser(MarkerParser):
    """DeepSeek-V3: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`.
    V3.1's `NAME<｜tool▁sep｜>{...}` inside the same markers is read too, since its chat template
    matches the same auto-detection."""

    name = "deepseek_v3"
    start = "<｜tool▁call▁begin｜>"
    end = "<｜tool▁call▁end｜>"
    silent = (_DS_CALLS_BEGIN, _DS_CALLS_END)

    def call_from_block(self, block: str) -> ToolCall | None:
        """The call in one block: V3's fenced JSON after the name line, or V3.1's bare JSON."""
        head, sep, rest = block.partition(_DS_SEP)
        if not sep:
            return None
        arguments = _json_object(rest)
        if arguments is not None:
            return _make_call(head.strip(), arguments)
        name, _, fenced = rest.partition("\n")
        match = _FENCED.fullmatch(fenced.strip())
        return _make_call(name.strip(), match.group(1)) if match else None


_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _llama3_calls(text: str) -> list[ToolCall]:
    """The calls when the whole text is `{...}` objects separated by `;`, else none."""
    rest = text.strip().removeprefix(_PYTHON_TAG).lstrip()
    calls: list[ToolCall] = []
    while rest:
        try:
            obj, end = _DECODER.raw_decode(rest)
        except json.JSONDecodeError:
            return []
        call = _call_from_json(obj)
        rest = rest[end:].lstrip()
        if call is None or (rest and not rest.startswith(";")):
            return []
        calls.append(call)
        rest = rest[1:].lstrip()
    return calls


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1 / 3.2 JSON tool calling: the whole output (after an optional `<|python_tag|>`)
    is `{"name": ..., "parameters": {...}}`, or several separated by `;`; otherwise content."""

    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        """A parser state for one streamed generation."""
        return _Llama3Stream()


class _Llama3Stream(ToolCallStream):
    """Whether the output is calls is known only at its end, so everything is held while it
    may be one (it starts with `{` or the python tag) and passed through once it cannot be."""

    def __init__(self) -> None:
        self._text = ""
        self._passing = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """See `ToolCallStream.feed`."""
        if self._passing:
            return delta, []
        self._text += delta
        head = self._text.lstrip()
        if not head or head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head):
            return "", []
        self._passing = True
        return self._text, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """See `ToolCallStream.finish`."""
        if self._passing:
            return "", []
        calls = _llama3_calls(self._text)
        return ("" if calls else self._text), calls


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, DeepSeekV3Parser)
}


def parser_for(name: str | None, chat_template: str | None) -> ToolCallParser | None:
    """The parser named by `--tool-call-parser`; `auto` or None picks one from the chat
    template's text (None when it shows no known format); `none`: None."""
    if name == "none":
        return None
    if name not in (None, "auto"):
        if name not in TOOL_CALL_PARSERS:
            known = ", ".join(["auto", "none", *sorted(TOOL_CALL_PARSERS)])
            raise ValueError(f"unknown --tool-call-parser {name!r}; known: {known}")
        return TOOL_CALL_PARSERS[name]()
    template = chat_template or ""
    if HermesParser.start in template:
        return HermesParser()
    if _DS_CALLS_BEGIN in template:
        return DeepSeekV3Parser()
    if _PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template):
        return Llama3JsonParser()
    return None


def _functions(tools: list[dict]) -> list[dict]:
    return [tool["function"] for tool in tools if tool.get("type") == "function"]


def _parameters(function: dict) -> dict:
    """A function's arguments schema, always of an object (OpenAI reads a missing one as "no
    arguments")."""
    parameters = function.get("parameters")
    return {"type": "object", "properties": {}} if parameters is None else \
        {"type": "object", **parameters}


def named_tool_schema(tools: list[dict], name: str) -> dict:
    """The schema of the output (the arguments object) when `tool_choice` names `name`."""
    for function in _functions(tools):
        if function["name"] == name:
            return _parameters(function)
    known = ", ".join(function["name"] for function in _functions(tools)) or "none"
    raise ValueError(f"tool_choice names function {name!r}, which is not in tools (known: {known})")


def required_tools_schema(tools: list[dict]) -> dict:
    """The schema of the output when `tool_choice` is "required": a non-empty JSON array of
    `{"name": ..., "parameters": {...}}`, one shape per function. Each function's `$defs` move
    to the root, where its `#/$defs/...` references point once it is nested here."""
    functions = _functions(tools)
    if not functions:
        raise ValueError('tool_choice "required" needs at least one function in tools')
    shapes = []
    defs: dict[str, dict] = {}
    for function in functions:
        parameters = _parameters(function)
        function_defs = parameters.pop("$defs", {})
        if not isinstance(function_defs, dict):
            raise ValueError(f"the $defs of function {function['name']!r} must be an object")
        for key, schema in function_defs.items():
            if defs.setdefault(key, schema) != schema:
                raise ValueError(f"tools define $defs {key!r} differently; rename one of them")
        shapes.append({
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": function["name"]},
                "parameters": parameters,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": shapes}}
    return {**schema, "$defs": defs} if defs else schema


def calls_from_required_output(text: str) -> list[ToolCall]:
    """The calls in an output constrained by `required_tools_schema`; none when it is not such
    an array (cut short by a length limit), and the caller then returns the text as content."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(items, list):
        return []
    calls = [_call_from_json(item) for item in items]
    return [] if None in calls else calls
