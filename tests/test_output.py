"""Incremental detokenization and stop strings, with the embedded model's tokenizer."""

from __future__ import annotations

import random

import pytest

from braid.engine.request import SamplingParams
from braid.frontend.detokenizer import IncrementalDetokenizer, StopMatcher
from braid.frontend.tracker import CompletionState
from braid.step import SequenceDelta

TEXT = "Crabs 🦀 and hearts ❤️: 日本語のテキスト, naïve café. Done!"


def pieces(tokenizer, ids, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, [1], **kwargs)
    out = [detok.add([t]) for t in ids[:-1]]
    out.append(detok.add(ids[-1:], final=True))
    return out, detok


def test_tokens_that_split_characters_are_held_until_complete(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    # Byte-level BPE: some tokens really do end inside a character.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    out, detok = pieces(tokenizer, ids)
    assert "".join(out) == TEXT == detok.text
    assert not any("\ufffd" in piece for piece in out)


def test_a_stop_string_spanning_tokens_cuts_the_text_before_it(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    stop = "テキスト, na"  # spans several tokens, some of them partial characters
    out, detok = pieces(tokenizer, ids, stop=(stop, "never there"))
    assert detok.stop_string == stop
    assert "".join(out) == detok.text == TEXT[:TEXT.index(stop)]


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    ids = tokenizer(" say hello world")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [1], stop=("world peace", "xyz"))
    emitted = "".join(detok.add([t]) for t in ids)
    assert emitted == " say hello "  # "world" may yet become "world peace"
    assert emitted + detok.add([], final=True) == " say hello world"
    detok = IncrementalDetokenizer(tokenizer, [1], stop=("world peace",))
    assert "".join(detok.add([t]) for t in tokenizer(" hello there")["input_ids"]) == \
        " hello there"  # nothing there can begin the stop string: nothing held


def test_completion_state_drops_the_stop_tokens_text_and_reports_stop_strings(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer(" one two three")["input_ids"]
    state = CompletionState(tokenizer, [1], SamplingParams(stop=("three",)))
    text = state.update(SequenceDelta("r", 0, ids[:2]))[0]
    text += state.update(SequenceDelta("r", 0, ids[2:]))[0]
    assert state.finished and (state.finish_reason, state.stop_reason) == ("stop", "three")
    assert text == state.text == " one two "
    plain = CompletionState(tokenizer, [1], SamplingParams(skip_special_tokens=False))
    plain.update(SequenceDelta("r", 0, [*ids, eos], finish_reason="stop", by_stop_token=True))
    assert plain.text == " one two three" and plain.token_ids == [*ids, eos]
    # A grammar that completes ends the sequence on a token of its text
    grammar = CompletionState(tokenizer, [1], SamplingParams())
    grammar.update(SequenceDelta("r", 0, ids, finish_reason="stop"))
    assert grammar.text == " one two three"


@pytest.mark.parametrize("min_tokens,finished", [(0, True), (5, False)])
def test_stop_strings_wait_for_min_tokens(tokenizer, min_tokens, finished):
    ids = tokenizer(" stop here please")["input_ids"]
    state = CompletionState(tokenizer, [1], SamplingParams(stop=("stop",),
                                                           min_tokens=min_tokens))
    state.update(SequenceDelta("r", 0, ids))
    assert state.finished == finished


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The plain definition: the earliest end of any stop string; of those, the longest."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def _held(text: str, stops: tuple[str, ...]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_the_stop_matcher_agrees_with_the_plain_definition():
    # One automaton over all stop strings, fed piece by piece, finds what scanning every stop
    # string's every prefix at every token found (the event loop's cost with many long stop
    # strings); each character is read once.
    rng = random.Random(0)
    for _ in range(2000):
        stops = tuple({"".join(rng.choice("ab") for _ in range(rng.randint(1, 5)))
                       for _ in range(rng.randint(1, 4))})
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        matcher, fed, found = StopMatcher(stops), 0, None
        while fed < len(text) and found is None:
            piece = text[fed:fed + rng.randint(1, 3)]
            hit = matcher.feed(piece)
            if hit is not None:
                found = (fed + hit[0], hit[1])
            else:
                fed += len(piece)
                assert matcher.held == _held(text[:fed], stops), (stops, text[:fed])
        assert found == _first_stop(text, stops), (stops, text)
