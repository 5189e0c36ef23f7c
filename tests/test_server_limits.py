"""Bodies that used to take `braid serve` down, stall it or slip past its checks, against the
shared `--tp 2` server (conftest's `server`): every one gets a clear 4xx (or is served within
its limits) and the server answers the next request. Last, what needs no server: /health after
a crash, where the API key comes from, a completion whose text cannot be made."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from types import SimpleNamespace

import httpx
import pytest
from conftest import API_KEY
from fastapi.testclient import TestClient
from server_utils import braid_server

from braid.config import default_model_path
from braid.engine.request import SamplingParams
from braid.loader.model_config import load_model_config
from braid.server.api import ServerContext, build_app
from braid.server.generation import generate, make_runs
from braid.server.metrics import Metrics
from braid.step import SequenceDelta

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def post(server, path: str, body, headers=AUTH, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.base_url}{path}", content=content, timeout=timeout,
                      headers={**headers, "Content-Type": "application/json"})


def assert_alive(server) -> None:
    response = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 200, response.text


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_top_k_beyond_int64_means_no_limit(server):
    # It passed validation, then overflowed an int64 array inside the engine's step: the
    # engine process died and the server with it.
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                "top_k": 9223372036854775808})
    assert response.status_code == 200, response.text
    assert_alive(server)


def test_token_ids_outside_the_vocabulary_are_refused(server):
    # A stop token id past the vocabulary, banned before min_tokens, indexed past the logits
    # on rank 0: the rank died, the server with it.
    for body, param in (
            ({"max_tokens": 4, "min_tokens": 1, "stop_token_ids": [100000000]},
             "stop_token_ids"),
            ({"max_tokens": 2, "logit_bias": {"100000000": 5}}, "logit_bias"),
            ({"max_tokens": 2, "logit_bias": {"x": 5}}, "logit_bias")):
        assert_error(post(server, "/v1/completions", {"prompt": "hi", **body}), 400, param)
    assert_alive(server)


def test_stop_strings_are_bounded_in_count_and_length(server):
    many = [f"stop-{i}" for i in range(17)]
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "stop": many}), 400, "stop")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "stop": "x" * 257}), 400,
                 "stop")
    response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "n": 4,
                                                "stop": ["y" * 256] * 16})
    assert response.status_code == 200, response.text


def test_prompts_times_n_is_bounded(server):
    error = assert_error(post(server, "/v1/completions",
                              {"prompt": [[1]] * 1000, "n": 128, "max_tokens": 1}), 400, "n")
    assert "--max-sequences-per-request" in error["message"]


def test_a_body_over_the_limit_is_413_before_it_is_parsed(server):
    huge = b'{"prompt": "' + b"a" * (5 << 20)  # not even valid JSON: never parsed
    assert_error(post(server, "/v1/completions", huge), 413)
    assert_alive(server)


def test_the_key_is_checked_before_the_body_and_on_every_route(server):
    # Before, a malformed body without a key got 400 (parsed first), and /tokenize and
    # /detokenize needed no key at all.
    assert_error(post(server, "/v1/completions", "{not json", headers={}), 401)
    assert_error(post(server, "/tokenize", {"prompt": "hi"}, headers={}), 401)
    assert_error(post(server, "/detokenize", {"tokens": [1]}, headers={}), 401)
    wrong = {"Authorization": "Bearer wrong"}
    assert_error(post(server, "/tokenize", {"prompt": "hi"}, headers=wrong), 401)
    assert httpx.get(f"{server.base_url}/openapi.json").status_code == 401
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200
    assert metric(server, "braid:requests_rejected_total", '{reason="unauthorized"}') >= 5


def test_null_max_tokens_and_logit_bias(server):
    # "max_tokens": null was a 500; it means as many as the context leaves. A bias of 100
    # on EOS ends the completion at once (logit_bias was dropped without a word).
    eos = post(server, "/tokenize", {"prompt": "<|im_end|>", "add_special_tokens": False})
    (eos_id,) = eos.json()["tokens"]
    response = post(server, "/v1/completions", {
        "prompt": "Count:", "max_tokens": None, "temperature": 0,
        "logit_bias": {str(eos_id): 100}})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    forced = post(server, "/v1/completions", {"prompt": "Count:", "max_tokens": 3,
                                              "temperature": 0, "logit_bias": {"1234": 100},
                                              "ignore_eos": True})
    text = forced.json()["choices"][0]["text"]
    assert text == post(server, "/detokenize", {"tokens": [1234] * 3}).json()["prompt"]


def test_a_lone_surrogate_prompt_is_400(server):
    assert_error(post(server, "/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}'),
                 400, "prompt")


def test_fields_braid_does_not_implement_are_refused_by_name(server):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "suffix": "end"}), 400,
                 "suffix")
    assert_error(post(server, "/v1/chat/completions", {**chat, "functions": [{"name": "f"}]}),
                 400, "functions")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "bad_words": ["a"]}),
                 400, "bad_words")
    for part in ({"type": "text", "text": 5}, {"type": "image_url", "image_url": {"url": "x"}}):
        assert_error(post(server, "/v1/chat/completions", {**chat, "messages": [
            {"role": "user", "content": [part]}]}), 400, "messages")  # was a 500, and ignored
    # The values that ask for nothing are fine, and unknown fields are still ignored.
    ok = post(server, "/v1/chat/completions", {**chat, "response_format": {"type": "text"},
                                               "tool_choice": "none", "user": "u1"})
    assert ok.status_code == 200, ok.text


def test_cache_salt_keeps_tenants_apart(server):
    long_prompt = "The history of the printing press in Europe, told slowly: " * 12

    def cached(salt: str | None) -> int:
        body = {"prompt": long_prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        response = post(server, "/v1/completions", body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0


def test_echo_logprobs_with_n_agree_streamed_and_not(server):
    # The prompt's logprobs are scored once (completion 0) and their JSON made once per
    # prompt, for every choice, streamed or not.
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
            "echo": True, "logprobs": 1, "n": 2}
    whole = post(server, "/v1/completions", body).json()["choices"]
    streamed: dict[int, dict] = {}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", headers=AUTH, timeout=60,
                      json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            (choice,) = json.loads(line[6:])["choices"]
            into = streamed.setdefault(choice["index"], {"text": "", "tokens": [],
                                                         "text_offset": []})
            into["text"] += choice["text"]
            into["tokens"] += choice["logprobs"]["tokens"]
            into["text_offset"] += choice["logprobs"]["text_offset"]
    assert len(whole) == 2 and sorted(streamed) == [0, 1]
    for choice in whole:
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and choice["text"].startswith(body["prompt"])
        assert streamed[choice["index"]] == {"text": choice["text"], "tokens": logprobs["tokens"],
                                             "text_offset": logprobs["text_offset"]}


def test_a_full_queue_answers_429_with_retry_after(server):
    # 256 long completions fill the running batch (--max-running-requests); then 5 requests
    # of 1024 one-token completions meet a queue of 4096 sequences: one of them must wait
    # outside it. The others are aborted when their clients leave.
    busy = {"prompt": [[1], [2]], "n": 128, "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    queued = {"prompt": [[3 + i] for i in range(8)], "n": 128, "max_tokens": 1}

    async def flood() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH,
                                     timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json=busy) as stream:
                await anext(stream.aiter_lines())  # running
                tasks = [asyncio.ensure_future(client.post("/v1/completions", json=queued))
                         for _ in range(5)]
                for done in asyncio.as_completed(tasks):
                    response = await done
                    if response.status_code == 429:
                        break
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return response

    full = asyncio.run(flood())
    assert full.headers["Retry-After"].isdigit()
    assert assert_error(full, 429)["code"] == "queue_full"
    assert metric(server, "braid:requests_rejected_total", '{reason="queue_full"}') >= 1
    deadline = time.monotonic() + 30  # the clients left: their requests are aborted
    while metric(server, "braid:num_sequences_queued") > 0:
        assert time.monotonic() < deadline, "the queue kept requests whose clients left"
        time.sleep(0.2)
    assert_alive(server)


def test_health_never_shows_the_engines_trace():
    # After a crash /health returned the engine's traceback to anyone who asked.
    model = default_model_path()
    engine = SimpleNamespace(dead="engine failed:\nTraceback (most recent call last): ...",
                             queued_sequences=0)
    ctx = ServerContext(engine=engine, tokenizer=None, model_config=load_model_config(model),
                        model_name="m", model_path=model, kv_capacity=1024,
                        eos_token_ids=frozenset(), metrics=Metrics())
    response = TestClient(build_app(ctx)).get("/health")
    assert response.status_code == 503 and "Traceback" not in response.text


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from braid.errors import UserError
    from braid.server.settings import ServeSettings

    monkeypatch.delenv("BRAID_API_KEY", raising=False)
    assert ServeSettings().key() is None
    monkeypatch.setenv("BRAID_API_KEY", "from-env")
    assert ServeSettings().key() == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n# a comment\n")
    assert ServeSettings(api_key_file=str(key_file)).key() == "from-file"
    assert ServeSettings(api_key="from-flag").key() == "from-flag"
    with pytest.raises(UserError, match="not both"):
        ServeSettings(api_key="a", api_key_file=str(key_file))


def test_a_completion_whose_text_fails_fails_alone():
    # An exception while detokenizing one completion used to end the whole request's
    # generator (a broken stream, or a 500 for all n); now that completion ends with an error
    # and is aborted in the engine, and its siblings go on.
    class Tokenizer:
        def decode(self, ids, **_) -> str:
            if 666 in ids:
                raise ValueError("undecodable")
            return "".join(chr(ord("a") + i % 26) for i in ids)

    aborted = []
    engine = SimpleNamespace(abort=lambda request_id, index=None: aborted.append(index),
                             release=lambda request_id: None)
    (run,) = make_runs("cmpl-x", [[5, 6]], SamplingParams(max_new_tokens=2, n=2), Tokenizer())
    deltas: asyncio.Queue = asyncio.Queue()
    for delta in (SequenceDelta(run.request_id, 0, [1]), SequenceDelta(run.request_id, 1, [666]),
                  SequenceDelta(run.request_id, 0, [2], finish_reason="length")):
        deltas.put_nowait(delta)

    async def events() -> list:
        return [e async for e in generate(engine, [run], deltas, Metrics())]

    asyncio.run(events())
    good, bad = run.completions
    assert bad.finish_reason == "error" and "detokenizing failed" in bad.error
    assert good.finish_reason == "length" and good.text == "bc"
    assert aborted == [1]



def test_connections_beyond_the_limit_get_503_at_once(tiny_llama, tmp_path):
    """--limit-concurrency bounds open connections (each may buffer a body of up to
    --max-request-bytes); one beyond is answered 503, not queued, and the server goes on."""
    with braid_server("--model", tiny_llama, "--limit-concurrency", "2",
                      log_dir=tmp_path) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        try:
            time.sleep(0.5)  # the server has accepted them
            assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 503
        finally:
            for connection in idle:
                connection.close()
        time.sleep(0.5)
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
