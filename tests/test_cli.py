"""The command line: answers, JSON output, and one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest


def braid(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "braid.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def rank_processes() -> set[int]:
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "multiprocessing.spawn" in cmdline and proc.pid != os.getpid():
            found.add(proc.pid)
    return found


def assert_user_error(result: subprocess.CompletedProcess, *phrases: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr
    for phrase in phrases:
        assert phrase in error_lines[0]


def test_generate_tp2_json_answers_the_question():
    before = rank_processes()
    result = braid("generate", "--tp", "2", "--chat", "--temperature", "0",
                   "--max-new-tokens", "24", "--json", "What is the capital of Japan?",
                   "Say hello.")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["What is the capital of Japan?", "Say hello."]
    assert "Tokyo" in rows[0]["text"]
    assert all(isinstance(t, int) for r in rows for t in r["token_ids"])
    assert rank_processes() <= before


def test_unknown_model_path():
    assert_user_error(braid("generate", "--model", "/no/such/model.gguf", "hi"),
                      "/no/such/model.gguf", "does not exist")


def test_tp_zero():
    assert_user_error(braid("generate", "--tp", "0", "hi"), "--tp")


def test_gguf_of_unsupported_architecture(tmp_path: Path):
    from gguf import GGUFWriter

    path = tmp_path / "tiny-gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_user_error(braid("generate", "--model", str(path), "hi"), "gpt2", "not supported")


def test_prompt_longer_than_the_context():
    before = rank_processes()
    result = braid("generate", "--tp", "2", "--max-total-tokens", "20000",
                   "word " * 9000)
    assert_user_error(result, "context of 8192 tokens")
    assert rank_processes() <= before


@pytest.mark.slow  # a message; tp 3 launches run in the default suite elsewhere
@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="the message names 2 cores")
def test_more_ranks_than_cores_warns():
    result = braid("generate", "--tp", "3", "--temperature", "0", "--max-new-tokens", "2", "Hi")
    assert result.returncode == 0, result.stderr
    assert "warning: --tp 3 exceeds the 2 usable cores" in result.stderr


@pytest.mark.parametrize("tp,constraint", [
    pytest.param(3, ["--regex", "[0-9]{3}-[a-z]{2,4}"], marks=pytest.mark.slow),
    (1, ["--json-schema", "SCHEMA"]),
])
def test_generate_with_a_constraint(tp, constraint, tmp_path: Path):
    """--regex and --json-schema, at every tp (only rank 0 samples, so only it is sent the
    grammar's bitmask)."""
    schema = {"type": "object", "properties": {"code": {"type": "integer", "maximum": 999}},
              "required": ["code"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    constraint = [str(tmp_path / "schema.json") if c == "SCHEMA" else c for c in constraint]
    result = braid("generate", "--tp", str(tp), "--temperature", "1", "--seed", "4",
                   "--max-new-tokens", "30", "--json", *constraint, "Code:", "Another code:")
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        text = json.loads(line)["text"]
        if constraint[0] == "--regex":
            assert re.fullmatch(constraint[1], text), text
        else:
            assert set(json.loads(text)) == {"code"}, text


def test_checkpoint_missing_a_weight_fails_naming_it(safetensors_folder, tmp_path: Path):
    # The same weights, but a config that asks for one more layer than they hold.
    folder = tmp_path / "one-layer-too-many"
    folder.mkdir()
    for item in Path(safetensors_folder).iterdir():
        (folder / item.name).symlink_to(item)
    config = json.loads((Path(safetensors_folder) / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    result = braid("generate", "--model", str(folder), "--tp", "2", "hi")
    assert result.returncode != 0
    assert "missing weights: model.layers.30." in result.stderr


BENCH_KEYS = {"backend", "model", "tp", "dtype", "batch_size", "input_len", "output_len",
              "prefill_latency", "prefill_throughput", "median_decode_latency",
              "median_decode_throughput", "total_latency", "overall_throughput"}


needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is optional: make bench-deps")


# overlap off: whether `auto` learns to overlap steps this small depends on the host's timing
# (what it learns is tested in test_step_choice)
TINY_BENCH = ["--model", "tiny_llama", "--tp", "2", "--overlap", "off"]


@pytest.mark.parametrize("backend_args", [
    # make test: eager (compiled steps' paths and tokens: test_compiled_parity)
    [*TINY_BENCH, "--compile", "off"],
    pytest.param(TINY_BENCH, marks=pytest.mark.slow),
    pytest.param(["--backend", "hf"], marks=pytest.mark.slow),
    pytest.param(["--backend", "llama.cpp"], marks=needs_llama_cpp)])
def test_bench_one_batch_prints_sglang_lines_and_a_jsonl_row(backend_args, tmp_path: Path,
                                                             request):
    """braid's run (a random Llama) says which path its steps took: with the default
    `--compile auto`, which compiles for a benchmark, compiled pieces for the prompts and the
    decode graph for the decode steps; eager steps with `--compile off`."""
    result_file = tmp_path / "bench.jsonl"
    backend_args = [request.getfixturevalue(a) if a == "tiny_llama" else a
                    for a in backend_args]
    result = braid("bench-one-batch", "--batch-size", "2", "--input-len", "16",
                   "--output-len", "4", "--result-file", str(result_file), *backend_args)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("Prefill. latency: ") and "token/s" in line for line in lines)
    assert sum(line.startswith("Decode ") for line in lines) == 3
    assert any(line.startswith("Decode.  median latency: ") for line in lines)
    assert any(line.startswith("Total. latency: ") for line in lines)
    (row,) = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert BENCH_KEYS <= set(row)
    assert row["batch_size"] == 2 and row["input_len"] == 16 and row["output_len"] == 4
    assert row["prefill_throughput"] > 0 and row["median_decode_throughput"] > 0
    assert "leaked semaphore" not in result.stderr  # the rank process's tqdm lock, once
    if "--backend" not in backend_args:
        paths = ("eager", "eager") if "--compile" in backend_args else ("pieces", "graph")
        assert (row["prefill_path"], row["decode_path"]) == paths
        assert f"(steps: {paths[1]})" in result.stdout


def test_bench_one_batch_says_how_to_get_llama_cpp(monkeypatch):
    from braid.bench import llama_cpp
    from braid.config import EngineConfig
    from braid.errors import UserError

    monkeypatch.setattr(llama_cpp.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="needs llama-cpp-python: run `make bench-deps`"):
        llama_cpp.LlamaCppWorkload(EngineConfig.create(model=__file__), 1, 32)


@pytest.mark.slow  # make test launches under torchrun in test_two_host_serving
def test_torchrun_launch_matches_spawned_ranks():
    args = ["generate", "--tp", "2", "--temperature", "0", "--max-new-tokens", "8", "--json",
            "The capital of France is"]
    spawned = braid(*args)
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "-m", "braid.cli", *args], capture_output=True, text=True, timeout=300)
    assert spawned.returncode == 0 and launched.returncode == 0, launched.stderr
    assert launched.stdout.strip() == spawned.stdout.strip()
    assert "Paris" in json.loads(launched.stdout)["text"]


@pytest.mark.slow  # bench-one-batch's lines and rows are checked in the default suite
def test_bench_overlap_modes_report_exposed_comm_and_crossover(tmp_path: Path):
    result_file = tmp_path / "overlap.jsonl"
    common = ["bench-one-batch", "--tp", "2", "--input-len", "16", "--output-len", "3",
              "--warmup", "0", "--compile", "off", "--result-file", str(result_file)]
    exposed = braid(*common, "--batch-size", "2", "--measure-exposed")
    assert exposed.returncode == 0, exposed.stderr
    assert "overlap efficiency" in exposed.stdout
    off, on = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert (off["overlap"], on["overlap"]) == ("off", "on")
    assert {"exposed_comm_prefill", "exposed_comm_decode"} <= set(off)
    assert "overlap_efficiency_prefill" in on
    result_file.unlink()
    sweep = braid(*common, "--overlap-sweep", "--sweep-batch-sizes", "1,2", "--repeat", "1")
    assert sweep.returncode == 0, sweep.stderr
    assert "set --overlap-min-tokens" in sweep.stdout
    rows = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert len(rows) == 4 and all("auto_over_best" in r for r in rows)


@pytest.mark.slow  # a benchmark run of its own
def test_bench_offline_runs_the_serving_requests(tmp_path: Path):
    out = tmp_path / "offline.jsonl"
    result = braid("bench-offline", "--tp", "2", "--num-prompts", "5", "--random-input-len", "20",
                   "--random-output-len", "3", "--random-range-ratio", "1.0", "--output-file",
                   str(out))
    assert result.returncode == 0, result.stderr
    assert "Offline Throughput Benchmark Result" in result.stdout
    row = json.loads(out.read_text())
    assert row["completed"] == 5 and row["total_output_tokens"] == 15
    assert row["total_input_tokens"] == 100 and row["output_throughput"] > 0


def test_serve_with_a_bad_model_fails_before_binding():
    assert_user_error(braid("serve", "--model", "/no/such/model.gguf"), "does not exist")
    assert_user_error(braid("serve", "--tp", "0"), "--tp")
