"""The APIs beside chat completions, through the official clients against the shared
`braid serve --tp 2`: OpenAI's Responses API (`client.responses`) and Anthropic's Messages API
(the `anthropic` SDK). Each is a translation of a chat request, so greedy text must equal chat
completions' for the same conversation, streamed or not."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pydantic
import pytest
from conftest import API_KEY

from braid.server.chat_tools import OutputBlocks, ToolOutput
from braid.server.responses_api import ResponseStore
from braid.server.tool_calls import HermesParser

QUESTION = "What is the capital of France?"
SYSTEM = "Answer in one short sentence."
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server):
    """The official `anthropic` client of the shared server."""
    import anthropic

    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                               timeout=120)


def chat_answer(client, model: str, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    """The greedy chat completion's text and finish reason."""
    answer = client.chat.completions.create(model=model, messages=messages,
                                            max_tokens=max_tokens, temperature=0)
    return answer.choices[0].message.content, answer.choices[0].finish_reason


def chat_text(client, model: str, messages: list[dict], max_tokens: int) -> str:
    return chat_answer(client, model, messages, max_tokens)[0]


# Anthropic's Messages API

def test_messages_text_equals_chat_streamed_and_not(claude, client, model):
    expected, finish = chat_answer(client, model, [{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": QUESTION}], 12)
    stop_reason = {"length": "max_tokens", "stop": "end_turn"}[finish]
    request = dict(model=model, max_tokens=12, system=SYSTEM, extra_body=GREEDY,
                   messages=[{"role": "user", "content": QUESTION}])
    message = claude.messages.create(**request)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected and message.stop_reason == stop_reason
    with claude.messages.stream(**request) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == expected and final.stop_reason == stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "content_block_start" in types and "message_delta" in types
    usage = final.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == (
        message.usage.input_tokens + message.usage.cache_read_input_tokens)


def test_messages_stop_sequences_and_count_tokens(server, claude, client, model):
    messages = [{"role": "user", "content": QUESTION}]
    text = chat_text(client, model, messages, 12)
    stop = text.split()[2]  # a word the greedy answer reaches
    message = claude.messages.create(model=model, max_tokens=12, messages=messages,
                                     stop_sequences=[stop], extra_body=GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]
    counted = claude.messages.count_tokens(model=model, system=SYSTEM, messages=messages)
    tokenized = httpx.post(f"{server.base_url}/tokenize", headers={"x-api-key": API_KEY},
                           json={"messages": [{"role": "system", "content": SYSTEM},
                                              *messages]}).json()
    assert counted.input_tokens == tokenized["count"]


def test_messages_tool_round_trip(claude, model):
    tools = [{"name": "get_weather", "description": "The weather of a city",
              "input_schema": WEATHER}]
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = claude.messages.create(model=model, max_tokens=40, tools=tools, messages=asked,
                                     tool_choice={"type": "any"}, extra_body=GREEDY)
    assert message.stop_reason == "tool_use"
    call = message.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather"
    assert isinstance(call.input.get("city"), str)
    with claude.messages.stream(model=model, max_tokens=40, tools=tools, messages=asked,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[-1].type == "tool_use" and streamed.stop_reason == "tool_use"
    answered = asked + [
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "Sunny, 21 C"}]}]
    answer = claude.messages.create(model=model, max_tokens=16, tools=tools, messages=answered,
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert answer.content[0].type == "text" and answer.content[0].text


def test_messages_errors_take_anthropics_shape(server, claude, model):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=model, max_tokens=8,
                               messages=[{"role": "user", "content": [
                                   {"type": "image", "source": {"type": "url", "url": "x"}}]}])
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content" in bad.value.body["error"]["message"]
    # max_tokens is required, as Anthropic requires it
    answer = httpx.post(f"{server.base_url}/v1/messages", headers={"x-api-key": API_KEY},
                        json={"model": model, "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 400 and "max_tokens" in answer.json()["error"]["message"]
    # SmolLM2 does not reason: thinking is refused by name
    with pytest.raises(anthropic.BadRequestError, match="thinking needs a reasoning model"):
        claude.messages.create(model=model, max_tokens=8, messages=[{"role": "user",
                                                                     "content": "x"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    answer = httpx.post(f"{server.base_url}/v1/messages", headers={"x-api-key": "wrong"},
                        json={"model": model, "max_tokens": 1, "messages": []})
    assert answer.status_code == 401
    assert answer.json()["error"]["type"] == "authentication_error"


# OpenAI's Responses API

def test_responses_text_equals_chat_streamed_and_not_and_continues(client, model):
    expected, finish = chat_answer(client, model, [{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": QUESTION}], 12)
    status = {"length": "incomplete", "stop": "completed"}[finish]
    request = dict(model=model, input=QUESTION, instructions=SYSTEM, max_output_tokens=12,
                   temperature=0)
    response = client.responses.create(**request)
    assert response.output_text == expected and response.status == status
    with client.responses.stream(**request) as stream:
        events = list(stream)
    assert "".join(event.delta for event in events
                   if event.type == "response.output_text.delta") == expected
    # Cut short by max_output_tokens, the API ends with .incomplete
    assert [event.type for event in events][-1] == f"response.{status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    # The stored response continues without resending (the instructions do not carry over)
    follow = "And of Italy?"
    continued = client.responses.create(model=model, input=follow, max_output_tokens=8,
                                        previous_response_id=response.id, temperature=0)
    assert continued.previous_response_id == response.id
    assert continued.output_text == chat_text(client, model, [
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": expected},
        {"role": "user", "content": follow}], 8)
    assert client.responses.retrieve(response.id).output_text == expected
    client.responses.delete(response.id)
    import openai

    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(model=model, input=follow, previous_response_id=response.id)
    assert gone.value.body["param"] == "previous_response_id"


def test_responses_function_call_round_trip_and_parse(client, model):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather of a city",
              "parameters": WEATHER}]
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = client.responses.create(model=model, input=asked, tools=tools,
                                       tool_choice="required", max_output_tokens=40,
                                       temperature=0)
    call = response.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    with client.responses.stream(model=model, input=asked, tools=tools, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=40) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in events
    assert events[-1] == "response.completed"
    assert streamed.output[-1].type == "function_call"
    answer = client.responses.create(
        model=model, tools=tools, tool_choice="none", max_output_tokens=12, temperature=0,
        input=asked + [call.model_dump(exclude_none=True),
                       {"type": "function_call_output", "call_id": call.call_id,
                        "output": "Sunny, 21 C"}])
    assert answer.output_text

    class City(pydantic.BaseModel):
        name: Literal["Paris", "Lyon", "Marseille"]
        coastal: bool

    parsed = client.responses.parse(model=model, input="A French city, as JSON",
                                    text_format=City, max_output_tokens=40, temperature=0)
    assert isinstance(parsed.output_parsed, City)


USER = {"role": "user", "content": "x"}


@pytest.mark.parametrize("body,param,words", [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input", "web_search_call"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "content.0.type"),
    ({"input": [USER] * 10_000}, "input", "at most"),  # more items than the context's tokens
    ({"input": [USER] * 3_000}, "input", "does not fit"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "nonsense"}}}}, "text", ""),
    ({"input": "x", "metadata": [[[[]]]]}, "metadata", ""),
])
def test_hostile_responses_bodies_get_a_400_naming_the_field(server, model, body, param, words):
    answer = httpx.post(f"{server.base_url}/v1/responses", timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": model, "max_output_tokens": 1, **body})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param, answer.text
    assert words in error["message"]


def test_a_response_store_evicts_the_least_recently_used() -> None:
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put({"id": name}, [])
    store.get("a")
    store.put({"id": "c"}, [])
    assert store.get("b") is None and store.get("a") and store.get("c")
    assert store.delete("a") and not store.delete("a")
    empty = ResponseStore(0)
    empty.put({"id": "a"}, [])
    assert empty.get("a") is None


def test_output_blocks_open_extend_and_close_in_turn() -> None:
    blocks = OutputBlocks(ToolOutput("auto", HermesParser()))
    steps = blocks.feed("Let me look. <tool_call>\n{\"name\": \"f\", \"arguments\": {}}")
    steps += blocks.feed("\n</tool_call>") + blocks.finish()
    shape = [(step.kind, step.block, step.index) for step in steps]
    assert shape[0] == ("start", "text", 0) and ("stop", "text", 0) in shape
    assert shape[-3:] == [("start", "call", 1), ("delta", "call", 1), ("stop", "call", 1)]
    assert steps[-3].name == "f" and json.loads(steps[-2].text) == {}


# Embeddings

def test_embeddings_through_the_openai_client(server, client, model):
    import base64

    import numpy as np
    import openai

    texts = ["The capital of France is Paris.", "Bonjour", "The capital of France is Paris."]
    floats = client.embeddings.create(model=model, input=texts)
    vectors = [np.array(item.embedding) for item in floats.data]
    assert [item.index for item in floats.data] == [0, 1, 2]
    assert all(abs(np.linalg.norm(v) - 1) < 1e-3 for v in vectors)
    assert float(vectors[0] @ vectors[2]) > 0.999 > float(vectors[0] @ vectors[1])
    tokens = httpx.post(f"{server.base_url}/tokenize", headers={"x-api-key": API_KEY},
                        json={"prompt": texts[1]}).json()["count"]
    alone = client.embeddings.create(model=model, input=texts[1], encoding_format="base64")
    assert alone.usage.prompt_tokens == tokens
    # Little-endian float32: the same vector, batched or not
    decoded = np.frombuffer(base64.b64decode(alone.data[0].embedding), "<f4")
    assert float(decoded @ vectors[1]) > 0.999
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=model, input="x", dimensions=64)
    assert refused.value.body["param"] == "dimensions"
    assert "not trained for shorter vectors" in refused.value.body["message"]
