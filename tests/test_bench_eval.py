"""bench-serving against a stub server that fails some requests, its copy-edit dataset, eval-mmlu
(braid against transformers on the same prompts), and braid plot."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from server_utils import free_port

from braid.bench.datasets import Dataset, sample_requests
from braid.bench.serving import ServingConfig, run_bench_serving, run_concurrency_table
from braid.errors import UserError
from braid.eval.mmlu import format_example, load_questions, subject_header
from braid.loader.tokenizer import apply_chat_template

MMLU = Path(__file__).resolve().parents[2] / "shared" / "data" / "mmlu"
needs_mmlu = pytest.mark.skipif(not MMLU.is_dir(), reason=f"MMLU data not at {MMLU}")

# SGLang bench_serving's JSON keys for what braid's bench-serving also measures.
SGLANG_KEYS = [
    "tag", "backend", "dataset_name", "request_rate", "max_concurrency", "random_input_len",
    "random_output_len", "random_range_ratio", "duration", "completed", "total_input_tokens",
    "total_output_tokens", "total_output_tokens_retokenized", "request_throughput",
    "input_throughput", "output_throughput", "total_throughput", "mean_e2e_latency_ms",
    "median_e2e_latency_ms", "std_e2e_latency_ms", "p99_e2e_latency_ms", "mean_ttft_ms",
    "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "std_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p95_itl_ms",
    "p99_itl_ms", "concurrency", "max_output_tokens_per_s", "max_concurrent_requests",
]


def stub_app(model_path: str) -> FastAPI:
    """An OpenAI-compatible stub: every third completion fails with a 500, the others stream
    `max_tokens` one-word chunks."""
    app = FastAPI()
    calls = {"n": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "root": model_path}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            return JSONResponse({"error": {"message": "stub failure", "type": "server_error",
                                           "param": None, "code": None}}, status_code=500)

        async def chunks():
            for _ in range(body["max_tokens"]):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': ' word'}]})}\n\n"
            usage = {"completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


@pytest.fixture
def stub_server(model_path):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(stub_app(model_path), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "stub server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_bench_serving_counts_failed_requests_and_uses_sglangs_keys(stub_server, tmp_path,
                                                                    capsys):
    out = tmp_path / "stub.jsonl"
    dataset = Dataset(num_prompts=9, random_input_len=12, random_output_len=5,
                      random_range_ratio=1.0)
    row = run_bench_serving(ServingConfig(
        base_url=stub_server, dataset=dataset, max_concurrency=2, warmup_requests=0,
        output_file=str(out), disable_tqdm=True, tag="stub", plot=str(tmp_path / "run.png")))
    captured = capsys.readouterr()
    assert row["completed"] == 6 and row["failed"] == 3
    assert "3 of 9 requests failed" in captured.err and "stub failure" in captured.err
    assert "Failed requests:                         3" in captured.out
    assert row["total_output_tokens"] == 6 * 5
    assert row["mean_ttft_ms"] <= row["mean_e2e_latency_ms"]
    assert set(SGLANG_KEYS) <= set(json.loads(out.read_text()))
    assert (tmp_path / "run.png").stat().st_size > 0


def test_bench_serving_compares_each_request_with_a_baseline_run(stub_server, tmp_path, capsys):
    """--output-details lists every request in order; --baseline-file divides each request's
    decode rate by the baseline's for the same request, and refuses other requests."""
    dataset = Dataset(num_prompts=9, random_input_len=12, random_output_len=5,
                      random_range_ratio=1.0)
    base = tmp_path / "base.jsonl"
    config = ServingConfig(base_url=stub_server, dataset=dataset, max_concurrency=2,
                           warmup_requests=0, disable_tqdm=True, output_details=True)
    first = run_bench_serving(replace(config, output_file=str(base)))
    assert len(first["decode_rates"]) == 9 and first["input_lens"] == [12] * 9
    assert sum(rate is None for rate in first["decode_rates"]) == 3  # the failed requests
    assert [error != "" for error in first["errors"]] == [rate is None
                                                          for rate in first["decode_rates"]]
    second = run_bench_serving(replace(config, baseline_file=str(base)))
    both = sum(a is not None and b is not None
               for a, b in zip(first["decode_rates"], second["decode_rates"]))
    assert len(second["decode_rate_ratios"]) == both >= 3 and second["texts_identical"] >= 3
    assert second["min_decode_rate_ratio"] <= second["median_decode_rate_ratio"]
    assert "Median decode-rate ratio:" in capsys.readouterr().out
    with pytest.raises(UserError, match="its requests are not these"):
        run_bench_serving(replace(config, baseline_file=str(base),
                                  dataset=replace(dataset, random_input_len=13)))


def test_the_concurrency_table_preset_runs_its_two_loads_and_prints_their_row(stub_server,
                                                                             capsys):
    """--preset concurrency-table: 16 prompts at concurrency 1, then 64 at 32, random ids of
    exactly 256 tokens asking 64 each, whatever the dataset flags said; one markdown row."""
    config = ServingConfig(base_url=stub_server, dataset=Dataset(num_prompts=3),
                           warmup_requests=0, disable_tqdm=True, tag="stub server",
                           preset="concurrency-table")
    rows = run_concurrency_table(config)
    assert [(r["num_prompts"], r["max_concurrency"]) for r in rows] == [(16, 1), (64, 32)]
    assert all(r["random_input_len"] == 256 and r["random_output_len"] == 64 for r in rows)
    assert all(r["total_input_tokens"] == 256 * r["completed"] for r in rows)
    table = capsys.readouterr().out.splitlines()[-3:]
    assert table[0] == ("| server | C 1 out tok/s | C 1 mean ITL | C 32 out tok/s | "
                        "C 32 mean ITL |")
    cells = table[2].split(" | ")
    assert cells[0] == "| stub server" and cells[2].endswith(" ms") and len(cells) == 5


def test_copy_edit_asks_to_rename_a_name_of_its_snippet_within_the_lengths(tokenizer):
    def dataset(seed: int) -> Dataset:
        return Dataset("copy-edit", num_prompts=16, random_input_len=400,
                       random_output_len=300, random_range_ratio=0.5, seed=seed)

    requests = sample_requests(dataset(7), tokenizer)
    assert len(requests) == 16
    assert requests == sample_requests(dataset(7), tokenizer)
    assert requests != sample_requests(dataset(8), tokenizer)
    # the text after the user's turn, so that the snippet is what lies before it
    suffix = tokenizer.decode(apply_chat_template(tokenizer, "MARK")).split("MARK")[1]
    kinds = set()
    for request in requests:
        assert request.prompt_len <= 400 and 1 <= request.output_len <= 300
        assert request.prompt_ids == tokenizer.encode(request.prompt, add_special_tokens=False)
        instruction = re.search(r"(rename|replace the word) `(\w+)` (?:to|with) `(\w+)`\. "
                                r"Output only the (?:code|text)\.\n\n", request.prompt)
        kind, old, new = instruction.groups()
        kinds.add(kind)
        assert request.prompt.endswith(suffix)
        snippet = request.prompt[instruction.end():-len(suffix)]
        assert re.search(rf"\b{old}\b", snippet) and not re.search(rf"\b{new}\b", snippet)
        answer = re.sub(rf"\b{old}\b", new, snippet)
        assert request.output_len <= len(tokenizer.encode(answer, add_special_tokens=False))
    assert kinds == {"rename", "replace the word"}
    with pytest.raises(UserError, match="--random-input-len of at least"):
        sample_requests(Dataset("copy-edit", num_prompts=1, random_input_len=20), tokenizer)


@needs_mmlu
def test_copy_edit_mmlu_copies_consecutive_questions_of_one_subject(tokenizer):
    """Text braid's code never held: runs of one subject's MMLU questions and choices, each
    request asking for one word to be replaced; refused without the folder."""
    dataset = Dataset("copy-edit-mmlu", dataset_path=str(MMLU), num_prompts=8,
                      random_input_len=600, random_output_len=400, seed=3)
    requests = sample_requests(dataset, tokenizer)
    assert requests == sample_requests(dataset, tokenizer)
    questions = {row[0] for file in (MMLU / "test").glob("*.csv")
                 for row in csv.reader(file.open(newline="", encoding="utf-8"))}
    for request in requests:
        assert request.prompt_len <= 600 and 1 <= request.output_len <= 400
        instruction = re.search(r"replace the word `(\w+)` with `(\w+)`\. Output only the "
                                r"text\.\n\n(.*)", request.prompt, re.S)
        old, new, snippet = instruction.groups()
        assert snippet.splitlines()[0] in questions and "\nA) " in snippet
        assert re.search(rf"\b{old}\b", snippet) and not re.search(rf"\b{new}\b", snippet)
    with pytest.raises(UserError, match="needs --dataset-path"):
        sample_requests(Dataset("copy-edit-mmlu", num_prompts=1, random_input_len=600),
                        tokenizer)


def test_mmlu_prompt_is_the_original_format(tmp_path):
    row = ["What is 2+2?", "3", "4", "5", "6", "B"]
    assert subject_header("high_school_physics") == (
        "The following are multiple choice questions (with answers) about  high school "
        "physics.\n\n")
    assert format_example(row, True) == "What is 2+2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer: B\n\n"
    assert format_example(row, False).endswith("\nD. 6\nAnswer:")


@needs_mmlu
def test_mmlu_questions_use_the_dev_shots():
    questions = load_questions(str(MMLU), "anatomy,astronomy", 5, 3)
    assert [(q.subject, q.index) for q in questions][:4] == [
        ("anatomy", 0), ("anatomy", 1), ("anatomy", 2), ("astronomy", 0)]
    prompt = questions[0].prompt
    assert prompt.count("\nAnswer: ") == 5 and prompt.endswith("\nAnswer:")
    assert questions[0].answer in "ABCD"


@needs_mmlu
@pytest.mark.slow  # make test checks the harness's prompts; this whole run compares backends
def test_eval_mmlu_braid_answers_as_transformers_does(tmp_path):
    out = tmp_path / "mmlu.jsonl"
    common = ["eval-mmlu", "--data-dir", str(MMLU), "--subjects", "anatomy", "--limit", "6",
              "--dtype", "fp32", "--output-file", str(out)]
    for backend in (["--tp", "2"], ["--backend", "hf"]):
        result = subprocess.run([sys.executable, "-m", "braid.cli", *common, *backend],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        assert "micro average" in result.stdout
    braid_run, hf_run = [json.loads(line) for line in out.read_text().splitlines()]
    assert braid_run["num_questions"] == hf_run["num_questions"] == 6
    assert [a[2] for a in braid_run["answers"]] == [a[2] for a in hf_run["answers"]]
    assert braid_run["prefix_cache_hit_rate"] > 0.5  # the shots were computed once a subject
    assert "100.0% of 6" in result.stdout


def test_plot_labels_rows_by_what_differs(tmp_path):
    from braid.bench.plots import labels, plot_results

    rows = [{"backend": "braid", "tp": 2, "overlap": "off", "prefill_throughput": 10.0,
             "median_decode_throughput": 5.0},
            {"backend": "braid", "tp": 2, "overlap": "on", "prefill_throughput": 12.0,
             "median_decode_throughput": 5.5}]
    keys = ["backend", "tp", "overlap"]
    assert labels(rows, keys) == ["overlap=off", "overlap=on"]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_results([str(path)], str(tmp_path / "p.png")) == ["bench-one-batch"]
    assert (tmp_path / "p.png").stat().st_size > 0
