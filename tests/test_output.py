"""Incremental detokenization and stop strings, with the embedded model's tokenizer."""

from __future__ import annotations

import pytest

from braid.engine.output import CompletionState, IncrementalDetokenizer
from braid.engine.request import SamplingParams, SequenceDelta

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
    plain.update(SequenceDelta("r", 0, [*ids, eos], finish_reason="stop"))
    assert plain.text == " one two three" and plain.token_ids == [*ids, eos]


@pytest.mark.parametrize("min_tokens,finished", [(0, True), (5, False)])
def test_stop_strings_wait_for_min_tokens(tokenizer, min_tokens, finished):
    ids = tokenizer(" stop here please")["input_ids"]
    state = CompletionState(tokenizer, [1], SamplingParams(stop=("stop",),
                                                           min_tokens=min_tokens))
    state.update(SequenceDelta("r", 0, ids))
    assert state.finished == finished
