"""Reasoning output: the `<think>...</think>` block a reasoning model (DeepSeek-R1, Qwen3,
QwQ) writes before its answer, split from the answer into `reasoning_content`.

Where the output starts depends on the prompt: DeepSeek-R1's template ends the prompt inside
an open `<think>` (the output is reasoning until `</think>`), Qwen3's leaves the output to
open it (and with thinking turned off writes an empty block into the prompt). So one parser
reads both, told by `prompt_state` whether the prompt left a block open; the names of
`--reasoning-parser` are those vLLM and SGLang use for the same markers. A parser's `split` is
its stream fed the whole text at once, so streamed and whole answers agree by construction.
"""

from __future__ import annotations

from braid.server.tool_calls import held_suffix

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def parser_for(name: str, chat_template: str | None) -> ThinkParser | None:
    """The parser `--reasoning-parser` names; `auto`: one where the chat template shows the
    markers (None without them); `none`: None."""
    if name == "none":
        return None
    if name == "auto":
        template = chat_template or ""
        return ThinkParser() if START in template and END in template else None
    if name not in REASONING_PARSERS:
        known = ", ".join(("auto", "none", *REASONING_PARSERS))
        raise ValueError(f"unknown --reasoning-parser {name!r}; known: {known}")
    return ThinkParser()


class ThinkParser:
    """Splits `<think>reasoning</think>answer`."""

    def prompt_state(self, prompt_tail: str) -> str:
        """Where a prompt ending with `prompt_tail` leaves the output: "inside" an open think
        block, "closed" after an empty one (thinking turned off), or free to "open" one."""
        start, end = prompt_tail.rfind(START), prompt_tail.rfind(END)
        if start > end:
            return "inside"
        return "closed" if end >= 0 else "open"

    def stream(self, in_reasoning: bool) -> ReasoningStream:
        return ReasoningStream(in_reasoning)

    def split(self, text: str, in_reasoning: bool) -> tuple[str | None, str]:
        """The reasoning (None where the output has none) and the answer."""
        stream = self.stream(in_reasoning)
        reasoning, answer = stream.feed(text)
        more_reasoning, more_answer = stream.finish()
        reasoning += more_reasoning
        return (reasoning if stream.reasoned else None), answer + more_answer


class ReasoningStream:
    """One output, fed as it is decoded: text that may still be a marker is held back. At the
    start, leading blanks and a `<think>` open the reasoning (in it already: a repeated
    `<think>` is dropped); `</think>` ends it; an output cut short in its reasoning is all
    reasoning."""

    def __init__(self, in_reasoning: bool) -> None:
        self._state = "opening" if not in_reasoning else "reasoning"
        self._at_start = True  # nothing of the reasoning emitted yet
        self._buffer = ""
        self.reasoned = in_reasoning  # whether the output has a reasoning part

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer that `text` releases."""
        self._buffer += text
        reasoning = answer = ""
        if self._state == "opening":
            head = self._buffer.lstrip()
            if START.startswith(head):
                return "", ""  # blanks, or the start of the marker: undecided
            if head.startswith(START):
                self._buffer, self._state, self.reasoned = head[len(START):], "reasoning", True
            else:
                self._state = "answer"
        if self._state == "reasoning":
            if self._at_start:
                head = self._buffer.lstrip()
                if START.startswith(head) and head:
                    return "", ""  # a repeated <think>, maybe
                if head.startswith(START):
                    self._buffer = head[len(START):]
            at = self._buffer.find(END)
            if at < 0:
                keep = len(self._buffer) - held_suffix(self._buffer, (END,))
                reasoning, self._buffer = self._buffer[:keep], self._buffer[keep:]
                self._at_start = self._at_start and not reasoning
                return reasoning, ""
            reasoning = self._buffer[:at]
            self._buffer, self._state = self._buffer[at + len(END):], "answer"
        answer, self._buffer = self._buffer, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What the end of the output releases: a held partial marker, as what it is in."""
        text, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return text, ""
        return "", text
