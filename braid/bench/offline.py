"""`braid bench-offline`: the requests `bench-serving` sends (same dataset flags, same seed),
run through the offline `LLM.generate` in one batch, as SGLang's bench_offline_throughput does:
the engine's throughput without HTTP, for the server's figures to be compared against."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from braid.bench.datasets import Dataset, sample_requests
from braid.bench.serving import line
from braid.config import EngineConfig
from braid.engine.request import SamplingParams
from braid.frontend.llm import LLM
from braid.settings import setting


@dataclass(frozen=True)
class OfflineConfig:
    """What `bench-offline` runs beside the engine's settings (its own flags)."""

    dataset: Dataset = field(default_factory=Dataset)
    output_file: str | None = setting(None, "append one JSON line here")
    tag: str | None = setting(None, "a label for this run in the JSON line (and in braid plot)")


def run_bench_offline(engine: EngineConfig, config: OfflineConfig) -> dict:
    """Generate every request (greedy, `ignore_eos`, each its own length); print SGLang's
    offline result block; append a JSON line."""
    dataset = config.dataset
    with LLM.from_config(engine) as llm:
        requests = sample_requests(dataset, llm.tokenizer)
        params = [SamplingParams(max_new_tokens=r.output_len, temperature=0, ignore_eos=True)
                  for r in requests]
        warm = requests[0]
        llm.generate([warm.prompt_ids], SamplingParams(max_new_tokens=min(warm.output_len, 32),
                                                       temperature=0, ignore_eos=True))
        start = time.perf_counter()
        outputs = llm.generate([r.prompt_ids for r in requests], params)
        duration = time.perf_counter() - start
    total_input = sum(r.prompt_len for r in requests)
    total_output = sum(len(o.token_ids) for o in outputs)
    row = {"tag": config.tag, "backend": "braid-offline", "dataset_name": dataset.dataset_name,
           "num_prompts": dataset.num_prompts, "random_input_len": dataset.random_input_len,
           "random_output_len": dataset.random_output_len,
           "random_range_ratio": dataset.random_range_ratio, "tp": engine.parallel.tp,
           "duration": duration,
           "completed": len(outputs), "total_input_tokens": total_input,
           "total_output_tokens": total_output, "request_throughput": len(outputs) / duration,
           "input_throughput": total_input / duration,
           "output_throughput": total_output / duration,
           "total_throughput": (total_input + total_output) / duration}
    print("\n{s:{c}^{n}}".format(s=" Offline Throughput Benchmark Result ", n=50, c="="))
    for label, key in (("Backend:", "backend"), ("Successful requests:", "completed"),
                       ("Benchmark duration (s):", "duration"),
                       ("Total input tokens:", "total_input_tokens"),
                       ("Total generated tokens:", "total_output_tokens"),
                       ("Request throughput (req/s):", "request_throughput"),
                       ("Input token throughput (tok/s):", "input_throughput"),
                       ("Output token throughput (tok/s):", "output_throughput"),
                       ("Total token throughput (tok/s):", "total_throughput")):
        line(label, row[key])
    print("=" * 50)
    if config.output_file:
        with open(config.output_file, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row
