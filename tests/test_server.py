"""`braid serve --tp 2` through the official `openai` client and raw HTTP: completions and chat,
streamed and not, n, stop strings, logprobs with echo, concurrency, bad input, disconnects,
metrics, and the server's lifecycle (signals, a dead rank)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from conftest import API_KEY as KEY
from server_utils import braid_server, shm_segments_of

from braid.cache import cache_root

AUTH = {"Authorization": f"Bearer {KEY}"}

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]
# The shared server decodes speculatively (n-gram lookup): a prompt that repeats makes its
# steps accept proposed tokens
REPEATING = "one two three four, one two three four, one two three four, one two"


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_greedy_completions_equal_braid_generate(server, client, model):
    offline = subprocess.run(
        [sys.executable, "-m", "braid.cli", "generate", "--tp", "2", "--temperature", "0",
         "--max-new-tokens", "24", "--json", *PROMPTS, REPEATING], capture_output=True,
        text=True, timeout=300)
    assert offline.returncode == 0, offline.stderr
    expected = [json.loads(line) for line in offline.stdout.splitlines()]
    accepted = metric(server, "braid:spec_decode_num_accepted_tokens_total")
    response = client.completions.create(model=model, prompt=[*PROMPTS, REPEATING],
                                         max_tokens=24, temperature=0)
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [e["text"] for e in expected]
    assert response.usage.completion_tokens == sum(len(e["token_ids"]) for e in expected)
    # The server speculates (n-gram) and its drafts are accepted on the repeating prompt, within
    # a few requests: a fresh sequence starts from the traffic's acceptance so far, which the
    # earlier tests' prompts may have left too low to propose within 24 tokens.
    for _ in range(3):
        if metric(server, "braid:spec_decode_num_accepted_tokens_total") > accepted:
            break
        longer = client.completions.create(model=model, prompt=REPEATING, max_tokens=48,
                                           temperature=0)
        assert longer.choices[0].text.startswith(expected[-1]["text"])
    assert metric(server, "braid:spec_decode_num_accepted_tokens_total") > accepted
    # Streamed, the pieces add up to the same text.
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24,
                                       temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == expected[0]["text"]


def test_chat_streamed_and_not(client, model):
    # Japan, not France: SmolLM2's bf16 answer to France opens on a near-tie ("The" against
    # "L", 0.25 apart in fp32) that tp 2 on an AMX Xeon resolves to French.
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                          temperature=0)
    text = full.choices[0].message.content
    assert "Tokyo" in text and full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_completions_and_usage(client, model):
    response = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=10, n=2,
                                         temperature=1.0, seed=5,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 20
    assert all(c.finish_reason == "length" for c in response.choices)


def test_stop_strings_cut_the_text(client, model):
    full = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=32,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0]
    stop = full.text.split()[3]  # a word from the middle of the greedy text
    for stream in (False, True):
        result = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=32,
                                           temperature=0, stop=[stop], stream=stream)
        if stream:
            chunks = list(result)
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = result.choices[0].text, result.choices[0].finish_reason
        assert text == full.text[:full.text.index(stop)]
        assert finish == "stop"


def test_echo_logprobs_score_the_prompt(client, model):
    response = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1,
                                         temperature=0, echo=True, logprobs=2)
    choice = response.choices[0]
    logprobs = choice.logprobs
    num_prompt = response.usage.prompt_tokens
    assert len(logprobs.tokens) == num_prompt + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert choice.text.startswith(PROMPTS[0])
    assert "".join(logprobs.tokens) == choice.text
    # Greedy: the generated token is the most likely one.
    generated = logprobs.top_logprobs[-1]
    assert max(generated.values()) == pytest.approx(logprobs.token_logprobs[-1])
    assert logprobs.text_offset[1] == len(logprobs.tokens[0])


def test_prompt_logprobs_rank_the_prompt_as_echo_scores_it(server, client, model):
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) its own and its top
    alternatives' logprob, rank and text, in completions (each choice, streamed in its first
    chunk) and chat (the response); the same logprobs as echo's."""
    echo = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1, echo=True,
                                     logprobs=1, temperature=0).choices[0].logprobs
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 1, "prompt_logprobs": 3}
    whole = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, json=body).json()
    scored = whole["choices"][0]["prompt_logprobs"]
    ids = httpx.post(f"{server.base_url}/tokenize", headers=AUTH,
                     json={"prompt": PROMPTS[0]}).json()["tokens"]
    assert scored[0] is None and len(scored) == len(ids)
    for token_id, expected, entry in zip(ids[1:], echo.token_logprobs[1:], scored[1:]):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(expected, abs=1e-5)
        top = sorted((e for e in entry.values() if e["rank"] <= 3), key=lambda e: e["rank"])
        assert [e["rank"] for e in top] == [1, 2, 3]
        assert own["rank"] == 1 + sum(e["logprob"] > own["logprob"] for e in top) or (
            own["rank"] > 3 and own["logprob"] <= top[-1]["logprob"])
        assert own["decoded_token"] == echo.tokens[ids.index(token_id)]
    streamed = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH,
                          json={**body, "stream": True}).text
    first = json.loads(streamed.split("data: ", 2)[1])
    assert first["choices"][0]["prompt_logprobs"] == scored
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", headers=AUTH, json={
        "model": model, "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


def test_echo_logprobs_of_a_long_prompt_under_two_batch_overlap(client, model):
    """1500 prompt tokens: the step is overlapped (auto, from 1024 tokens here) and its logits
    gather is chunked through the shm ring beside the other micro-batch's all-reduce."""
    prompt = list(range(1000, 2500))
    response = client.completions.create(model=model, prompt=prompt, max_tokens=1, echo=True,
                                         logprobs=0, temperature=0)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 1501 and logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])


def test_64_concurrent_streams_complete_with_correct_usage(server, model):
    async def one(client, i: int) -> tuple[int, int, str]:
        stream = await client.completions.create(
            model=model, prompt=f"Story number {i}:", max_tokens=4 + i % 5, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return usage.completion_tokens, 4 + i % 5, text

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY,
                                      max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    assert all(got == asked for got, asked, _ in results)
    assert all(text for _, _, text in results)


@pytest.mark.parametrize("body,status,param", [
    ("{not json", 400, None),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": [1] * 9000}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 9000}, 400, "max_tokens"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ({}, 400, "prompt"),
])
def test_bad_input_gets_a_4xx_and_the_server_goes_on(server, client, model, body, status,
                                                   param):
    content = body if isinstance(body, str) else json.dumps({"model": model, **body})
    response = httpx.post(f"{server.base_url}/v1/completions", content=content,
                          headers={"Authorization": f"Bearer {KEY}",
                                   "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    good = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert good.usage.completion_tokens >= 1


def test_wrong_api_key_is_401(server, model):
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt="Hi", max_tokens=2)
    response = httpx.get(f"{server.base_url}/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_chat_bad_input(server, client, model):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=model, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=model, max_tokens=2, top_logprobs=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    chat = client.chat.completions.create(model=model, max_tokens=3, logprobs=True,
                                          top_logprobs=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_a_disconnect_frees_the_requests_blocks(server, model):
    body = {"model": model, "prompt": "Count to a thousand:", "max_tokens": 2000,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(5))]
        assert all(line.startswith("data: ") or not line for line in received)
        assert metric(server, "braid:num_requests_running") == 1
        assert metric(server, "braid:kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 10
    while metric(server, "braid:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "the disconnected request kept its KV blocks"
        time.sleep(0.2)
    assert metric(server, "braid:num_requests_running") == 0


def test_models_health_tokenize_and_metrics(server, client, model, model_path):
    listed = client.models.list().data
    assert [m.id for m in listed] == [model] and model.startswith("SmolLM2")
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    auth = {"Authorization": f"Bearer {KEY}"}
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPTS[0]},
                        headers=auth).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]},
                      headers=auth).json()["prompt"]
    assert text == PROMPTS[0]
    exposition = httpx.get(f"{server.base_url}/metrics").text
    for name in ("braid:num_requests_waiting", "braid:prompt_tokens_total",
                 "braid:generation_tokens_total", "braid:time_to_first_token_seconds_bucket",
                 "braid:inter_token_latency_seconds_bucket",
                 "braid:e2e_request_latency_seconds_bucket", "braid:prefix_cache_hit_rate",
                 "braid:num_preemptions_total", "braid:engine_steps_two_batch_overlap_total",
                 "braid:engine_steps_dp_linear_total", "braid:num_sequences_queued",
                 "braid:requests_rejected_total"):
        assert name in exposition, name
    assert metric(server, "braid:generation_tokens_total") > 0
    held = {(rank, kind): metric(server, f'braid:rank_memory_bytes{{kind="{kind}",rank="{rank}"}}')
            for rank in (0, 1) for kind in ("weights", "kv_cache", "resident")}
    file_bytes = os.path.getsize(model_path)
    assert 0.5 * file_bytes < held[0, "weights"] + held[1, "weights"] <= 1.05 * file_bytes
    for rank in (0, 1):  # a rank's process holds its weights and its cache
        assert held[rank, "resident"] > held[rank, "weights"] + held[rank, "kv_cache"] > 0


SERVING_KEYS = {"backend", "completed", "total_input_tokens", "total_output_tokens",
                "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_itl_ms", "p95_itl_ms", "p99_itl_ms", "mean_tpot_ms", "mean_e2e_latency_ms",
                "concurrency", "max_output_tokens_per_s", "max_concurrent_requests"}


@pytest.mark.slow  # a server of its own; make test: bench-serving's tests in test_bench_eval
def test_bench_serving_prints_sglangs_block_and_counts_failures(server, tmp_path):
    def bench(*args):
        return subprocess.run(
            [sys.executable, "-m", "braid.cli", "bench-serving", "--base-url", server.base_url,
             "--num-prompts", "6", "--random-output-len", "4", "--random-range-ratio", "1.0",
             "--max-concurrency", "3", "--output-file", str(out), *args],
            capture_output=True, text=True, timeout=300, env={**os.environ,
                                                              "OPENAI_API_KEY": KEY})

    out = tmp_path / "serving.jsonl"
    ok = bench("--random-input-len", "16", "--tokenize-prompt")
    assert ok.returncode == 0, ok.stderr
    labels = [line.split(":")[0] for line in ok.stdout.splitlines() if ":" in line]
    assert labels.index("Successful requests") < labels.index("Output token throughput (tok/s)")
    assert "Max ITL (ms)" in labels and "P90 TTFT (ms)" in labels
    row = json.loads(out.read_text().splitlines()[-1])
    assert SERVING_KEYS <= set(row)
    assert row["completed"] == 6 and row["total_output_tokens"] == 24
    assert row["total_input_tokens"] == 6 * 16
    failed = bench("--random-input-len", "9000", "--warmup-requests", "0")
    assert failed.returncode == 0, failed.stderr
    assert "6 of 6 requests failed" in failed.stderr and "context" in failed.stderr
    assert json.loads(out.read_text().splitlines()[-1])["completed"] == 0


def test_a_dead_rank_ends_the_server_within_10s(tmp_path, tiny_llama):
    with braid_server("--model", tiny_llama, "--tp", "2", log_dir=tmp_path) as server:
        engine, ranks = server.engine_and_ranks()
        base = server.base_url
        stream = httpx.stream("POST", f"{base}/v1/completions", timeout=30, json={
            "prompt": "Count to a thousand:", "max_tokens": 2000, "stream": True,
            "ignore_eos": True})
        with stream as response:
            lines = response.iter_lines()
            next(lines)
            ranks[1].kill()
            killed = time.monotonic()
            rest = "\n".join(lines)  # the stream ends, with an error
        assert "error" in rest
        server.proc.wait(timeout=10)
        assert time.monotonic() - killed < 10
        assert server.proc.returncode not in (0, None), server.output()
        assert "rank 1" in server.output()
        assert not shm_segments_of(engine.pid)


@pytest.mark.slow  # compiled steps: test_compiled_parity; saved graphs: test_compiled_step
def test_a_server_compiles_its_steps_at_start_and_loads_them_the_next_time(tiny_llama,
                                                                          tmp_path,
                                                                          monkeypatch):
    """The default `--compile auto`: the first start compiles the decode graphs and pieces
    (saying so), steps then take the compiled paths (`/metrics`); a second start of the same
    model loads the saved graphs instead of compiling them."""
    # A braid cache of this test's own (the session's may hold this model's graphs, saved by
    # the parity tests); inductor's kernels stay shared, as they only make the compile faster.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # One rank (test_compiled_parity compiles tp 2 and 3), in fp32 as its tp 1 launch (inductor
    # finds its kernels), and a step budget under the large GEMMs' row class (fewer pieces)
    budget = ("--dtype", "fp32", "--max-num-batched-tokens", "256")
    with braid_server("--model", tiny_llama, "--compile", "auto", *budget,
                      log_dir=tmp_path) as server:
        for prompt in PROMPTS:  # prompts (pieces), then decode steps (the graph)
            response = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0})
            assert response.status_code == 200, response.text
        text = httpx.get(f"{server.base_url}/metrics").text
        assert re.search(r'^braid:engine_steps_by_path_total\{path="graph"\} ([1-9]\d*)',
                         text, re.MULTILINE)
        assert re.search(r'^braid:engine_steps_by_path_total\{path="pieces"\} ([1-9]\d*)',
                         text, re.MULTILINE)
        assert "decode graphs 0 loaded, 2 compiled" in server.output()
    with braid_server("--model", tiny_llama, "--compile", "auto", *budget,
                      log_dir=tmp_path) as server:
        assert "decode graphs 2 loaded, 0 compiled" in server.output()
