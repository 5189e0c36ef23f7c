"""What `braid bench-one-batch` and its variants share: the run's settings (`OneBatch`), the
workloads that time one static batch (braid's engine, or transformers and llama.cpp in a rank
process set up like braid's), and SGLang's bench_one_batch output lines and JSONL rows."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from braid import settings
from braid.config import DTYPES, EngineConfig
from braid.distributed.ranks.local import LocalRankGroup
from braid.errors import UserError
from braid.loader.model_config import ModelConfig, load_model_config
from braid.platform import usable_cores
from braid.settings import setting


@dataclass(frozen=True)
class OneBatch:
    """What `braid bench-one-batch` runs beside the engine's settings (its own flags)."""

    batch_size: int = setting(1, "prompts in the batch", at_least=1)
    input_len: int = setting(1024, "tokens per prompt", at_least=1)
    output_len: int = setting(16, "tokens to generate per prompt", at_least=1)
    backend: str = setting(
        "braid", "hf: the same workload through Hugging Face transformers; llama.cpp: through "
        "llama.cpp on the same GGUF file (needs `make bench-deps`)",
        choices=("braid", "hf", "llama.cpp"))
    result_file: str | None = setting(None, "append one JSONL row here")
    warmup: int = setting(1, "untimed runs first", at_least=0)
    measure_exposed: bool = setting(
        False, "time overlap off and on, each with and without collectives: exposed "
        "communication and overlap efficiency")
    overlap_sweep: bool = setting(
        False, "overlap off/on over --sweep-batch-sizes (prefill of --input-len tokens each, and "
        "decode); prints the --overlap-min-tokens to set")
    compare_dp_linear: str | None = setting(
        None, "time these --dp-linear modes (e.g. off,on) alternately in one launch, --repeat "
        "rounds; prints each mode's best prefill and median decode and the ratios to the first "
        "mode", metavar="MODES")
    sweep_batch_sizes: str = setting("1,4,16,64", "batch sizes of --overlap-sweep")
    repeat: int = setting(2, "timed runs per sweep point or compared mode (the fastest counts)",
                          at_least=1)

    def __post_init__(self) -> None:
        settings.check(self)


@dataclass
class BenchResult:
    """Timings of one run: the prefill step and each decode step, in seconds; for braid, the
    paths they took (`StepResult.path`: compiled graph, pieces or eager), so a figure never
    silently comes from the slow path."""

    prefill_latency: float
    decode_latencies: list[float]
    prefill_path: str = ""
    decode_paths: tuple[str, ...] = ()

    def latencies(self) -> tuple[float, float]:
        """(prefill latency, median decode-step latency, 0 without decode steps)."""
        decode = statistics.median(self.decode_latencies) if self.decode_latencies else 0.0
        return self.prefill_latency, decode

    def row(self, batch_size: int, input_len: int, output_len: int) -> dict:
        median = self.latencies()[1]
        total = self.prefill_latency + sum(self.decode_latencies)
        return {
            "prefill_latency": self.prefill_latency,
            "prefill_throughput": batch_size * input_len / self.prefill_latency,
            "median_decode_latency": median,
            "median_decode_throughput": batch_size / median if median else 0.0,
            "total_latency": total,
            "overall_throughput": batch_size * (input_len + output_len) / total,
            "prefill_path": self.prefill_path,
            "decode_path": ",".join(sorted(set(self.decode_paths))),
        }


def random_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """[batch_size, input_len] random token ids (the same for every backend at a given seed)."""
    return np.random.default_rng(seed).integers(0, vocab_size, (batch_size, input_len))


def time_steps(prefill: Callable[[], None], decode: Callable[[], None],
               output_len: int) -> BenchResult:
    """Time one prefill call and `output_len - 1` decode calls."""
    start = time.perf_counter()
    prefill()
    prefill_latency = time.perf_counter() - start
    decode_latencies = []
    for _ in range(output_len - 1):
        start = time.perf_counter()
        decode()
        decode_latencies.append(time.perf_counter() - start)
    return BenchResult(prefill_latency, decode_latencies)


class BraidWorkload:
    """Batches through braid's engine: one prefill step, then one decode step at a time.

    Sized for the largest batch it will run; overlap and skip-comm are per-step settings, so
    one launch can time several configurations side by side.
    """

    def __init__(self, engine: EngineConfig, max_batch: int, max_input: int,
                 max_output: int) -> None:
        from braid.frontend.llm import LLM

        # The whole batch prefills in one step, as in SGLang's bench_one_batch; no prefix
        # cache, so repeated runs of the same prompts compute them again.
        self.llm = LLM.from_config(engine.replace(
            max_total_tokens=max(engine.kv_cache.max_total_tokens,
                                 max_batch * (max_input + max_output + 16)),
            max_num_batched_tokens=max(engine.scheduler.max_num_batched_tokens,
                                       max_batch * max_input),
            max_running_requests=max_batch, prefix_caching=False))
        self.llm.core.compile_steps()  # a benchmark measures the steady state

    def run(self, prompts: np.ndarray, output_len: int, overlap: str | None = None,
            skip_comm: bool | None = None, dp_linear: str | None = None) -> BenchResult:
        from braid.engine.request import SamplingParams

        configured = self.llm.config.switches
        self.llm.switch(overlap=overlap or configured.overlap,
                        skip_comm=configured.skip_comm if skip_comm is None else skip_comm,
                        dp_linear=dp_linear or configured.dp_linear)
        params = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
        for ids in prompts:
            self.llm.add_request(ids.tolist(), params)
        paths = []

        def step() -> None:
            self.llm.step()
            paths.append(self.llm.core.last_path)

        result = time_steps(step, step, output_len)
        assert not self.llm.has_work
        result.prefill_path, result.decode_paths = paths[0], tuple(paths[1:])
        return result

    def learning(self) -> bool:
        """Whether `auto` still probes settings for a step size it has run."""
        return "probing" in self.llm.core.chooser.choices().values()

    def choices(self) -> dict[str, str]:
        """What `auto` chose per step bucket (empty where nothing was left to choose)."""
        return self.llm.core.chooser.choices()

    def kernels(self) -> str:
        """Rank 0's kernel plan, in a line."""
        return self.llm.core.executor.ready.kernels

    def memory(self) -> dict[str, list[int]]:
        """Each rank's weight and KV cache bytes."""
        readies = self.llm.core.executor.readies
        return {"weight_bytes": [r.weight_bytes for r in readies],
                "kv_cache_bytes": [r.kv_cache_bytes for r in readies]}

    def close(self) -> None:
        self.llm.close()


class RankWorkload:
    """Another engine's batches, timed in one rank process started like braid's (same core
    pinning, all cores' threads, same allocator settings), so the comparison differs only in
    the engine. `worker(rank, world_size, conn, *args)` loads it, then `serve_runs`."""

    def __init__(self, backend: str, tp: int, worker: Callable, args: tuple) -> None:
        if tp != 1:
            raise UserError(f"--backend {backend} runs one process; use it with --tp 1")
        self.group = LocalRankGroup(1, worker, args)
        self.group.gather()

    def run(self, prompts: np.ndarray, output_len: int) -> BenchResult:
        return self.group.request(("run", (prompts, output_len)))

    def close(self) -> None:
        self.group.close()


def serve_runs(conn, time_run: Callable[[np.ndarray, int], BenchResult]) -> None:
    """A `RankWorkload` worker's loop once loaded: say ready, then time each requested run."""
    conn.send(("ok", "ready"))
    while True:
        kind, request = conn.recv()
        if kind == "stop":
            return
        conn.send(("ok", time_run(*request)))


class HFWorkload(RankWorkload):
    """Batches through Hugging Face transformers' dense model and its own KV cache."""

    def __init__(self, engine: EngineConfig) -> None:
        super().__init__("hf", engine.parallel.tp, hf_worker, (engine.model, engine.dtype))


def hf_worker(rank: int, world_size: int, conn, model: str, dtype: str) -> None:
    """Rank entry point for `HFWorkload`: load the model, then time each requested run."""
    from braid.loader.transformers_model import load_transformers_model

    hf_model = load_transformers_model(model, DTYPES[dtype])
    serve_runs(conn, lambda prompts, output_len: _time_hf(
        hf_model, torch.from_numpy(prompts), output_len))


@torch.inference_mode()
def _time_hf(hf_model, input_ids: torch.Tensor, output_len: int) -> BenchResult:
    state = {}

    def forward(ids: torch.Tensor, cache=None) -> None:
        out = hf_model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        state["cache"], state["next"] = out.past_key_values, out.logits[:, -1].argmax(-1)

    return time_steps(lambda: forward(input_ids),
                      lambda: forward(state["next"][:, None], state["cache"]), output_len)


def print_result(result: BenchResult, batch_size: int, input_len: int, output_len: int) -> dict:
    """Print SGLang's bench_one_batch lines for a run; return its JSONL fields."""
    row = result.row(batch_size, input_len, output_len)
    print(f"Prefill. latency: {row['prefill_latency']:6.5f} s, "
          f"throughput: {row['prefill_throughput']:9.2f} token/s"
          f"{_path(row['prefill_path'])}")
    for i, latency in enumerate(result.decode_latencies[:5]):
        print(f"Decode {i}. Batch size: {batch_size}, latency: {latency:6.5f} s, "
              f"throughput: {batch_size / latency:9.2f} token/s")
    print(f"Decode.  median latency: {row['median_decode_latency']:6.5f} s, "
          f"median throughput: {row['median_decode_throughput']:9.2f} token/s"
          f"{_path(row['decode_path'])}")
    print(f"Total. latency: {row['total_latency']:6.3f} s, "
          f"throughput: {row['overall_throughput']:9.2f} token/s")
    return row


def print_memory(row: dict) -> None:
    """The memory line of a run: what each rank holds, and the peak of all processes."""
    def gb(values: list[int]) -> str:
        return " + ".join(f"{v / 1e9:.3f}" for v in values) + " GB"

    parts = [f"{label} per rank {gb(row[key])}" for key, label in
             (("weight_bytes", "weights"), ("kv_cache_bytes", "KV cache")) if key in row]
    if row.get("peak_pss_bytes"):
        parts.append(f"peak PSS of all processes {row['peak_pss_bytes'] / 1e9:.3f} GB")
    if parts:
        print("Memory: " + "; ".join(parts))


def _path(path: str) -> str:
    return f" (steps: {path})" if path else ""


def check_run(engine: EngineConfig, bench: OneBatch) -> ModelConfig:
    """Validate the settings; the model's config."""
    config = load_model_config(engine.model)
    if bench.input_len + bench.output_len > config.max_position_embeddings:
        raise UserError(f"--input-len + --output-len exceeds the model's context of "
                        f"{config.max_position_embeddings} tokens")
    if bench.backend != "braid" and (bench.overlap_sweep or bench.measure_exposed
                                     or bench.compare_dp_linear):
        raise UserError("--overlap-sweep, --measure-exposed and --compare-dp-linear measure "
                        f"braid; drop --backend {bench.backend}")
    return config


# Most extra warm-up runs while `auto` probes: one prefill step per run, and across hosts 4
# settings, each untimed once and timed up to `step_choice.PROBES` times.
MAX_LEARNING_RUNS = 16


def timed(workload, prompts: np.ndarray, output_len: int, warmup: int, **settings) -> BenchResult:
    """Warm-up runs (short, more while `auto` still probes this batch's step sizes: a benchmark
    measures what it chose), then one timed run."""
    learning = getattr(workload, "learning", lambda: False)
    runs = 0
    while runs < warmup or (learning() and runs < warmup + MAX_LEARNING_RUNS):
        workload.run(prompts, min(output_len, 4), **settings)
        runs += 1
    return workload.run(prompts, output_len, **settings)


def fastest_by_mode(workload: BraidWorkload, prompts: np.ndarray, output_len: int,
                    repeat: int, setting: str, modes: list[str]) -> dict[str, tuple[float, float]]:
    """Each mode of a per-step `setting` (a `BraidWorkload.run` keyword: overlap, dp_linear)
    run `repeat` times, the modes alternating so the host's drift hits them alike; per mode the
    fastest prefill and the fastest median decode step."""
    best = {mode: (float("inf"), float("inf")) for mode in modes}
    for _ in range(repeat):
        for mode in modes:
            prefill, decode = workload.run(prompts, output_len, **{setting: mode}).latencies()
            best[mode] = (min(best[mode][0], prefill), min(best[mode][1], decode))
    return best


def base_row(engine: EngineConfig, bench: OneBatch, **fields) -> dict:
    """The JSONL fields that describe a run's configuration."""
    # llama.cpp computes with the file's own weight types
    dtype = "gguf" if bench.backend == "llama.cpp" else engine.dtype
    row = {"backend": bench.backend, "model": engine.model, "tp": engine.parallel.tp,
           "dtype": dtype, "comm": engine.parallel.comm, "overlap": engine.switches.overlap,
           "dp_linear": engine.switches.dp_linear,
           "comm_compression": engine.switches.comm_compression,
           "skip_comm": engine.switches.skip_comm, "quantization": engine.compile.quantization,
           "kv_cache_dtype": engine.kv_cache.kv_cache_dtype, "compile": engine.compile.mode,
           "batch_size": bench.batch_size, "input_len": bench.input_len,
           "output_len": bench.output_len, "cores": len(usable_cores())}
    row.update(fields)
    return row


def print_header(row: dict) -> None:
    """One line naming the configuration of the run printed below it."""
    print(f"Benchmark: backend={row['backend']} tp={row['tp']} dtype={row['dtype']} "
          f"comm={row['comm']} comm_compression={row['comm_compression']} "
          f"overlap={row['overlap']} dp_linear={row['dp_linear']} "
          f"compile={row['compile']}"
          f"{' skip_comm' if row['skip_comm'] else ''}"
          f"{' quantization=int8' if row['quantization'] == 'int8' else ''}"
          f"{' kv_cache_dtype=int8' if row['kv_cache_dtype'] == 'int8' else ''}"
          f" batch_size={row['batch_size']} input_len={row['input_len']} "
          f"output_len={row['output_len']} cores={row['cores']}")


def append_rows(path: str | None, rows: list[dict]) -> None:
    """Append JSONL rows to `path` (nothing when no --result-file was given)."""
    if path:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
