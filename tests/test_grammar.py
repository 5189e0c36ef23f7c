"""Constrained decoding in the engine: constraints checked when made, the bitmask the driver
fills and rank 0 applies, and a grammar through the scheduler (a sequence ends when its
grammar is complete; preemption and recompute change no constrained output)."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch
from engine_utils import FAKE_EOS, fake_core, run_requests

from braid.engine.grammar import Grammars, StructuredOutputs, accept_token, closed_objects
from braid.engine.plan import sampling_batch
from braid.engine.request import SamplingParams, Sequence
from braid.errors import UserError
from braid.worker.sampler import apply_grammar_mask, sample

DIGITS = r"[0-9]{3}-[0-9]{2,5}"


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(lambda: tokenizer, len(tokenizer), lambda t: frozenset({t.eos_token_id}))


@pytest.mark.parametrize("kwargs,field", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"regex": "[a-", "source": "guided_regex"}, "guided_regex"),
    ({"json": {"type": "strnig"}, "source": "response_format"}, "response_format"),
    ({"json": "{oops"}, "structured_outputs"),
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs"),
    ({"choice": []}, "structured_outputs"),
    ({"grammar": "root ::= missing"}, "structured_outputs"),
    ({"grammar": "start: missing"}, "structured_outputs"),
])
def test_an_invalid_constraint_names_its_source(kwargs, field):
    with pytest.raises(UserError) as error:
        StructuredOutputs(**kwargs)
    assert error.value.param == field


def test_objects_without_a_rule_for_other_keys_take_none():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "list": {"type": "array", "items": {"$ref": "#/$defs/item"}},
        "either": {"anyOf": [{"type": "object", "properties": {"b": {}}}, {"type": "null"}]},
        "both": {"allOf": [{"properties": {"d": {}}}, {"properties": {"e": {}}}]}},
        "$defs": {"item": {"type": "object", "properties": {"c": {}}}}}
    closed = closed_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert set(props) == {"properties", "open", "list", "either", "both"}  # a key "properties"
    assert props["properties"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True  # an explicit rule is kept
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["item"]["additionalProperties"] is False
    # allOf's branches describe one object together: closing one would refuse the other's keys
    assert props["both"] == schema["properties"]["both"]
    assert "additionalProperties" not in schema  # the request's own schema is not changed


def decode_randomly(grammars, tokenizer, structured: StructuredOutputs, seed: int) -> str:
    """Sample from random logits under the grammar's mask until the grammar is complete: the
    bitmask, the sampler's masking and the matcher's advance, without a model."""
    matcher = grammars.matcher(structured)
    generator = torch.Generator().manual_seed(seed)
    seq = Sequence(0, "r", 0, [1], SamplingParams(temperature=1.0))
    tokens: list[int] = []
    for _ in range(64):
        batch = sampling_batch([seq])
        batch.grammar_rows = np.array([0])
        mask, errors = grammars.fill([matcher])
        assert not errors
        logits = torch.randn(1, len(tokenizer), generator=generator) * 4
        (token,), failed = sample(logits, batch, generator, mask)
        assert not failed
        tokens.append(token)
        if accept_token(matcher, token):
            return tokenizer.decode(tokens, skip_special_tokens=True)
    raise AssertionError(f"the grammar never completed: {tokenizer.decode(tokens)!r}")


@pytest.mark.parametrize("seed", range(8))
def test_masked_sampling_only_makes_what_the_grammar_allows(grammars, tokenizer, seed):
    assert re.fullmatch(DIGITS, decode_randomly(grammars, tokenizer,
                                                StructuredOutputs(regex=DIGITS), seed))
    choice = decode_randomly(grammars, tokenizer,
                             StructuredOutputs(choice=["red", "green", "blue sky"]), seed)
    assert choice in ("red", "green", "blue sky")


def accepts(grammars, tokenizer, structured: StructuredOutputs, text: str) -> bool:
    """Whether the grammar takes `text` (tokenized as one piece) to its end."""
    matcher = grammars.matcher(structured)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_a_constraint_after_reasoning_leaves_the_think_block_free(grammars, tokenizer):
    """With a reasoning model, a schema constrains the answer after `</think>`: any text
    before it (from inside a block the prompt opened, or one the output opens), not after."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    inside = StructuredOutputs(json=schema, reasoning="inside")
    assert accepts(grammars, tokenizer, inside, 'Let me see: {"a" is it?\n</think>{"a": 1}')
    assert not accepts(grammars, tokenizer, inside, '{"a": 1}')  # the block must end first
    assert not accepts(grammars, tokenizer, inside, 'hm</think>{"a": 1} and more')
    opens = StructuredOutputs(json=schema, reasoning="opens")
    assert accepts(grammars, tokenizer, opens, '<think>free text</think>{"a": 2}')
    assert accepts(grammars, tokenizer, opens, '{"a": 2}')  # no reasoning at all
    assert not accepts(grammars, tokenizer, opens, 'free text{"a": 2}')
    choice = StructuredOutputs(choice=["yes", "no"], reasoning="inside")
    assert accepts(grammars, tokenizer, choice, "why not</think>yes")
    assert StructuredOutputs(json=schema).describes_answer
    assert not StructuredOutputs(regex="a+").describes_answer


@pytest.mark.parametrize("vocab", [64, 1000, 49152])
def test_the_mask_operator_agrees_with_the_unpacked_mask(vocab):
    """braid's operator (contiguous fp32 on CPU) and the path other devices take (here: made
    to take it with a strided view), on mixed, empty and full words and a vocabulary that is
    not a multiple of 32."""
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    mask = rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    mask[0, ::3], mask[1, 1::3] = 0, -1
    rows = np.array([0, 2, 3])
    logits = torch.randn(5, vocab)
    allowed = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    expected = logits.clone()
    expected[torch.from_numpy(rows)] = torch.where(torch.from_numpy(allowed.astype(bool)),
                                                   logits[torch.from_numpy(rows)],
                                                   float("-inf"))
    native = logits.clone()
    apply_grammar_mask(native, rows, mask)
    strided = logits.t().contiguous().t()
    apply_grammar_mask(strided, rows, mask)
    assert torch.equal(native, expected) and torch.equal(strided, expected)


def test_a_row_the_mask_leaves_nothing_fails_alone(grammars):
    seq = Sequence(0, "r", 0, [1], SamplingParams(temperature=0))
    batch = sampling_batch([seq, seq])
    batch.grammar_rows = np.array([1])
    tokens, errors = sample(torch.randn(2, grammars.vocab_size), batch, torch.Generator(),
                            np.zeros((1, grammars.words), dtype=np.int32))
    assert tokens[0] is not None and tokens[1] is None and "no token is allowed" in errors[1]


def constrained_core(tokenizer, **engine_args):
    """An engine core over the fake model with SmolLM2's tokenizer for its grammars (the fake's
    1000-token vocabulary is the tokenizer's first 1000 tokens; the digits are among them)."""
    core, runner = fake_core(**engine_args)
    core.grammars = Grammars(lambda: tokenizer, len(tokenizer), lambda t: frozenset({FAKE_EOS}))
    return core, runner


def test_a_grammar_ends_its_sequence_and_preemption_changes_nothing(tokenizer):
    params = SamplingParams(max_new_tokens=70, temperature=0,
                            structured=StructuredOutputs(regex="[0-9]{60}"))
    prompts = [[5, 6, 7] * 4, [9, 8] * 10]
    roomy, _ = constrained_core(tokenizer, max_total_tokens=65536)
    expected = run_requests(roomy, prompts, params)
    assert all(len(out) == 60 for out in expected)  # one digit a token, then complete
    assert all(re.fullmatch("[0-9]{60}", tokenizer.decode(out)) for out in expected)
    tight, _ = constrained_core(tokenizer, max_total_tokens=128, block_size=16,
                                max_num_batched_tokens=8)
    assert run_requests(tight, prompts, params) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.stats().grammar.masks == sum(len(out) for out in expected)


def test_grammars_compile_beside_the_steps_of_a_server(tokenizer):
    """A server's engine compiles a grammar it has not seen in the grammar thread: the
    request waits (counted as waiting), the running sequences step meanwhile, and it runs
    once compiled; a grammar that does not compile for the vocabulary fails its request alone,
    with a `UserError` naming its field."""
    from braid.engine.request import Request

    core, _ = constrained_core(tokenizer)
    core.compile_grammars_aside = True
    release = threading.Event()
    compile_now = core.grammars._template
    core.grammars._template = lambda structured: (release.wait(60), compile_now(structured))[1]
    plain = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    digits = SamplingParams(max_new_tokens=12, temperature=0, n=2,
                            structured=StructuredOutputs(regex="[0-9]{5}"))
    unknown = SamplingParams(max_new_tokens=4, structured=StructuredOutputs(
        grammar="start: <|nosuchtoken|>", source="guided_grammar"))
    core.add(Request("plain", [5, 6, 7], plain, frozenset({FAKE_EOS})))
    core.add(Request("digits", [9, 8], digits, frozenset({FAKE_EOS})))
    core.add(Request("unknown", [9, 8], unknown, frozenset({FAKE_EOS})))
    assert core.stats().num_waiting == 1 + 2 + 1  # "plain" not admitted yet; 3 compiling
    done = {}
    for _ in range(8):  # "plain" runs to its end while the grammars wait
        assert core.admit_compiled() == []
        for delta in core.step():
            done.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert set(done) == {"plain"} and len(done["plain"]) == 8
    release.set()
    failed = []
    deadline = time.monotonic() + 60
    while core.num_compiling and time.monotonic() < deadline:
        failed += core.admit_compiled()
        time.sleep(0.01)
    ((request, error),) = failed
    assert request.request_id == "unknown" and isinstance(error, UserError)
    assert error.param == "guided_grammar"
    outputs = {}
    while core.has_work:
        for delta in core.step():
            outputs.setdefault((delta.request_id, delta.index), []).extend(delta.new_token_ids)
    assert all(re.fullmatch("[0-9]{5}", tokenizer.decode(outputs["digits", i])) for i in (0, 1))
