"""Incremental detokenization and stop strings: a completion's tokens turned into text pieces.

Shared by the offline `LLM` and the server (through `braid.frontend.tracker`), which receive
token deltas from the engine core. Two things make this more than `decode`:
- a token may end inside a UTF-8 character (byte-level BPE splits emoji and CJK characters);
  its bytes are held until the character is complete, so no piece carries a replacement
  character that the full text does not;
- a stop string may span tokens; text that could still become the start of one (a suffix that
  is a prefix of a stop string) is held back, and the completion ends just before the stop
  string (OpenAI's behaviour: the stop string is not output). One automaton over all the stop
  strings reads each character once, so many long stop strings cost no more per token than
  one short one (the server's event loop runs this for every token of every stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# Prompt tokens decoded before the output, so tokenizers that mark word starts (SentencePiece's
# leading space) decode the first output token as they would in context.
_CONTEXT_TOKENS = 6


@dataclass(frozen=True)
class _Automaton:
    """Aho-Corasick automaton of a set of stop strings: per state, its transitions, its
    fallback, its depth (the length of the prefix it stands for) and the longest stop string
    that ends there."""

    goto: tuple[dict[str, int], ...]
    fail: tuple[int, ...]
    depth: tuple[int, ...]
    match: tuple[str | None, ...]


@lru_cache(maxsize=32)  # up to 16 x 256 characters each: a few MB at most
def _automaton(stops: tuple[str, ...]) -> _Automaton:
    goto: list[dict[str, int]] = [{}]
    depth, match = [0], [None]
    for stop in stops:
        state = 0
        for ch in stop:
            if ch not in goto[state]:
                goto.append({})
                depth.append(depth[state] + 1)
                match.append(None)
                goto[state][ch] = len(goto) - 1
            state = goto[state][ch]
        match[state] = stop
    fail = [0] * len(goto)
    frontier = [0]
    while frontier:  # breadth first: a state's fallback is shallower, so already known
        following = []
        for state in frontier:
            for ch, nxt in goto[state].items():
                if state:
                    back = fail[state]
                    while back and ch not in goto[back]:
                        back = fail[back]
                    fail[nxt] = goto[back].get(ch, 0)
                if match[nxt] is None:
                    match[nxt] = match[fail[nxt]]
                following.append(nxt)
        frontier = following
    return _Automaton(tuple(goto), tuple(fail), tuple(depth), tuple(match))


class StopMatcher:
    """Finds stop strings in text fed to it piece by piece, reading each character once."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._a = _automaton(tuple(stops))
        self._state = 0

    @property
    def held(self) -> int:
        """Length of the longest end of the text so far that begins a stop string."""
        return self._a.depth[self._state]

    def feed(self, text: str, report: bool = True) -> tuple[int, str] | None:
        """Read `text`; the first stop string completed in it (when `report`) as (the index
        in `text` just after it, the stop string), or None. The earliest to end wins; of
        those ending at one place, the longest."""
        a, state = self._a, self._state
        for i, ch in enumerate(text):
            while state and ch not in a.goto[state]:
                state = a.fail[state]
            state = a.goto[state].get(ch, 0)
            if report and a.match[state] is not None:
                self._state = state
                return i + 1, a.match[state]
        self._state = state
        return None


class IncrementalDetokenizer:
    """Text of a growing token sequence, emitted in pieces (see the module docstring)."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already taken
        self.read_offset = len(self.ids)
        self.stop_matcher = StopMatcher(stop) if stop else None
        self.text = ""  # the output's text so far (cut before a stop string once found)
        self.emitted = 0  # characters of `text` handed out
        self.stop_string: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int], final: bool = False, check_stop: bool = True) -> str:
        """Take new tokens; return the text that can be emitted now. `final`: no more tokens
        will come, so everything pending is emitted. Stop strings are checked only while
        `check_stop` (not before `min_tokens`)."""
        for token in token_ids:
            if self.stop_string is not None:
                break
            self.ids.append(token)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self._append(full[len(prefix):], check_stop)
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if final and self.stop_string is None and self.read_offset < len(self.ids):
            # A character left incomplete at the end: emit what the bytes decode to.
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self._append(self._decode(self.ids[self.prefix_offset:])[len(prefix):], check_stop)
            self.read_offset = len(self.ids)
        done = final or self.stop_string is not None
        end = len(self.text) if done else max(self.emitted, len(self.text) - self._held())
        piece = self.text[self.emitted:end]
        self.emitted = end
        return piece

    def _held(self) -> int:
        """Characters at the end of the text that could still begin a stop string."""
        return self.stop_matcher.held if self.stop_matcher is not None else 0

    def _append(self, piece: str, check_stop: bool) -> None:
        start = len(self.text)
        self.text += piece
        if self.stop_matcher is None:
            return
        found = self.stop_matcher.feed(piece, report=check_stop)
        if found is not None:
            end, self.stop_string = found
            self.text = self.text[:start + end - len(self.stop_string)]
