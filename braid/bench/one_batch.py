"""`braid bench-one-batch`: latency of one static batch, printed as SGLang's bench_one_batch does.

A batch of `batch_size` random prompts of `input_len` tokens is prefilled in one step, then
decoded greedily for `output_len - 1` steps. `--backend hf` runs the same workload through
Hugging Face transformers (dense weights, its KV cache, logits of the last token only) in a
process set up like braid's ranks, so ratios can be taken side by side; `--backend llama.cpp`
through llama.cpp on the same GGUF file (`braid.bench.llama_cpp`). The overlap modes
(`--measure-exposed`, `--overlap-sweep`) live in `braid.bench.overlap`, `--compare-dp-linear`
in `braid.bench.dp_linear`; what they share in `braid.bench.harness`.
"""

from __future__ import annotations

from braid.bench.dp_linear import compare_dp_linear
from braid.bench.harness import (
    BraidWorkload,
    HFWorkload,
    OneBatch,
    append_rows,
    base_row,
    check_run,
    print_header,
    print_memory,
    print_result,
    random_prompts,
    timed,
)
from braid.bench.llama_cpp import LlamaCppWorkload
from braid.bench.memory import PeakMemory
from braid.bench.overlap import measure_exposed, run_overlap_sweep
from braid.config import EngineConfig


def run_bench_one_batch(engine: EngineConfig, bench: OneBatch) -> list[dict]:
    """Run the benchmark; print SGLang's lines; append JSONL rows."""
    config = check_run(engine, bench)
    if bench.overlap_sweep:
        return run_overlap_sweep(engine, bench, config)
    prompts = random_prompts(bench.batch_size, bench.input_len, config.vocab_size)
    with PeakMemory() as peak:  # from the start: loading can be the peak
        workload = _workload(engine, bench)
        try:
            if bench.measure_exposed:
                rows = measure_exposed(engine, bench, workload, prompts)
            elif bench.compare_dp_linear:
                rows = compare_dp_linear(engine, bench, workload, prompts)
            else:
                rows = [_timed_row(engine, bench, workload, prompts, peak)]
        finally:
            workload.close()
    append_rows(bench.result_file, rows)
    return rows


def _workload(engine: EngineConfig, bench: OneBatch):
    if bench.backend == "hf":
        return HFWorkload(engine)
    if bench.backend == "llama.cpp":
        return LlamaCppWorkload(engine, bench.batch_size, bench.input_len + bench.output_len)
    return BraidWorkload(engine, bench.batch_size, bench.input_len, bench.output_len)


def _timed_row(engine: EngineConfig, bench: OneBatch, workload, prompts, peak: PeakMemory
               ) -> dict:
    """Time the batch once (after warm-up runs); print its lines; its JSONL row."""
    result = timed(workload, prompts, bench.output_len, bench.warmup)
    choices = getattr(workload, "choices", dict)()
    kernels = getattr(workload, "kernels", str)()
    row = base_row(engine, bench, **({"auto_choices": choices} if choices else {}),
                   **({"kernels": kernels} if kernels else {}))
    print_header(row)
    if kernels:
        print(f"Kernels: {kernels}")
    row.update(print_result(result, bench.batch_size, bench.input_len, bench.output_len))
    if choices:
        print("auto chose: " + "; ".join(f"{k} {v}" for k, v in choices.items()))
    row.update(getattr(workload, "memory", dict)(), peak_pss_bytes=peak.bytes)
    print_memory(row)
    return row
