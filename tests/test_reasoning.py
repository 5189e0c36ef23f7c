"""Reasoning output: `<think>...</think>` split from the answer into `reasoning_content`
(chat), thinking blocks (Messages) and reasoning items (Responses), whole and streamed; a
constraint on the answer leaves the reasoning free; a request turns thinking off through the
template (`chat_template_kwargs.enable_thinking`). The Messages and Responses streams are
also driven here without a server, from scripted text events (reasoning, a failure)."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import httpx
import pytest

from braid.server.anthropic import MessagesResponder
from braid.server.chat_tools import ToolOutput
from braid.server.reasoning import ThinkParser, parser_for
from braid.server.responses_api import ResponsesRequest, ResponsesResponder

# Qwen3's way: the output opens its think block; thinking off writes an empty one into the prompt
QWEN3_LIKE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}")
REASONING, ANSWER = "Two and two make four.", "The answer is 4."
SCRIPT = f"<think>{REASONING}</think>{ANSWER}"
SCRIPTED = re.escape(SCRIPT)  # the regular expression that makes a model write SCRIPT


@pytest.mark.parametrize("text,in_reasoning,expected", [
    (SCRIPT, False, (REASONING, ANSWER)),
    ("\n<think>a</think>\n\nb", False, ("a", "\n\nb")),
    ("no thinking", False, (None, "no thinking")),
    ("<think>cut short", False, ("cut short", "")),
    ("a</think>b", True, ("a", "b")),  # DeepSeek-R1: the prompt opened the block
    ("<think>a</think>b", True, ("a", "b")),  # ... and the output repeats the marker
    ("all reasoning", True, ("all reasoning", "")),
    ("a < b </thin", True, ("a < b </thin", "")),
    ("", False, (None, "")),
])
def test_split_streamed_at_every_point_equals_whole(text, in_reasoning, expected):
    parser = ThinkParser()
    assert parser.split(text, in_reasoning) == expected
    for cut in range(len(text) + 1):
        stream = parser.stream(in_reasoning)
        pieces = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        assert "".join(r for r, _ in pieces) == (expected[0] or "")
        assert "".join(a for _, a in pieces) == expected[1]


def test_the_prompt_says_where_the_output_starts():
    parser = ThinkParser()
    assert parser.prompt_state("<|im_start|>assistant\n<think>\n") == "inside"
    assert parser.prompt_state("assistant\n<think>\n\n</think>\n\n") == "closed"
    assert parser.prompt_state("<|im_start|>assistant\n") == "open"
    assert parser_for("auto", QWEN3_LIKE_TEMPLATE) is not None
    assert parser_for("auto", "{{ messages }}") is None and parser_for("none", "") is None
    with pytest.raises(ValueError, match="known: auto, none, deepseek_r1, qwen3"):
        parser_for("r2", None)


def finished_run(text: str) -> SimpleNamespace:
    state = SimpleNamespace(text=text, finish_reason="stop", stop_reason=None, token_ids=[1],
                            finished=True, invalid=False, error=None)
    return SimpleNamespace(completions=[state], prompt_ids=[1, 2], num_cached_tokens=0)


async def _collect(chunks) -> list[dict]:
    return [chunk async for chunk in chunks]


def streamed(responder, text: str) -> list[dict]:
    """The responder's events for `text` arriving in two pieces."""
    run = responder.run
    cut = len(text) // 3

    async def events():
        for piece, last in ((text[:cut], False), (text[cut:], True)):
            yield SimpleNamespace(state=SimpleNamespace(
                finish_reason="stop" if last else None, finished=last, invalid=False),
                text=piece, run=run)

    return asyncio.run(_collect(responder.chunks(events())))


def test_messages_and_responses_carry_the_reasoning_whole_and_streamed():
    tools = ToolOutput("none", reasoning=ThinkParser())
    message = MessagesResponder("m", finished_run(SCRIPT), tools, True)
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in message.response()[
        "content"]] == [("thinking", REASONING), ("text", ANSWER)]
    deltas = [e["delta"] for e in streamed(message, SCRIPT) if e["type"] ==
              "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == REASONING
    assert "".join(d.get("text", "") for d in deltas) == ANSWER

    request = ResponsesRequest(input="x")
    response = ResponsesResponder("m", request, [], finished_run(SCRIPT), tools, True, None)
    output = response.response()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"][0]["text"] == REASONING
    events = streamed(response, SCRIPT)
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.reasoning_text.delta") == REASONING
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.output_text.delta") == ANSWER
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_failed_generation_ends_each_stream_with_its_apis_error_event():
    """The engine's per-request failure, streamed: Anthropic's `error` event (its type by
    whose fault it was) and the Responses API's `response.failed`, nothing after them."""
    run = finished_run("partial")
    state = run.completions[0]
    state.finish_reason, state.error = "error", "no token is allowed"

    async def failed():
        yield SimpleNamespace(state=SimpleNamespace(finish_reason="error", finished=True,
                                                    invalid=True, error=state.error),
                              text="", run=run)

    message = MessagesResponder("m", run, ToolOutput("none"), True)
    events = asyncio.run(_collect(message.chunks(failed())))
    assert [e["type"] for e in events] == ["message_start", "error"]
    assert events[-1]["error"]["type"] == "invalid_request_error"
    response = ResponsesResponder("m", ResponsesRequest(input="x"), [], run, ToolOutput("none"),
                                  True, None)
    events = asyncio.run(_collect(response.chunks(failed())))
    assert [e["type"] for e in events][-1] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "invalid_prompt"


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory, tiny_llama):
    from server_utils import braid_server

    folder = tmp_path_factory.mktemp("reasoning")
    template = folder / "qwen3_like.jinja"
    template.write_text(QWEN3_LIKE_TEMPLATE)
    with braid_server("--model", tiny_llama, "--chat-template", str(template),
                      log_dir=folder) as server:
        yield server


def chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 48,
        "temperature": 0, **body})


def test_a_scripted_think_block_is_split_exactly_streamed_and_not(reasoning_server):
    whole = chat(reasoning_server, regex=SCRIPTED).json()["choices"][0]["message"]
    assert (whole["reasoning_content"], whole["content"]) == (REASONING, ANSWER)
    text = chat(reasoning_server, regex=SCRIPTED, stream=True).text
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in text.splitlines()
              if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER


def test_thinking_turned_off_constrains_the_whole_answer(reasoning_server):
    body = {"guided_choice": ["yes", "no"], "chat_template_kwargs": {"enable_thinking": False}}
    message = chat(reasoning_server, **body).json()["choices"][0]["message"]
    assert message["content"] in ("yes", "no") and "reasoning_content" not in message
    refused = chat(reasoning_server, chat_template_kwargs={"messages": []})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs"
