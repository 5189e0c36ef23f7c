"""Overlap measurements of `braid bench-one-batch`, each in one launch (settings switch per step).

- `--measure-exposed`: overlap off and on, each with and without collectives
  (`exposed = T - T_skip_comm`), and the overlap efficiency `1 - exposed_on / exposed_off`.
- `--overlap-sweep`: overlap off, on and auto over batch sizes, for prefill and decode; checks
  `auto` (with `--overlap-min-tokens`) against the better of off and on at every point, and
  prints the token count from which overlap pays (the `--overlap-min-tokens` to set).
"""

from __future__ import annotations

import numpy as np

from braid.bench.harness import (
    BraidWorkload,
    OneBatch,
    append_rows,
    base_row,
    fastest_by_mode,
    print_header,
    print_result,
    random_prompts,
    timed,
)
from braid.config import EngineConfig
from braid.loader.model_config import ModelConfig


def measure_exposed(engine: EngineConfig, bench: OneBatch, workload: BraidWorkload,
                    prompts: np.ndarray) -> list[dict]:
    """Overlap off/on x with/without collectives on one launch; rows for off and on."""
    timings = {}
    for overlap in ("off", "on"):
        for skip in (False, True):
            result = timed(workload, prompts, bench.output_len, bench.warmup, overlap=overlap,
                           skip_comm=skip)
            row = base_row(engine, bench, overlap=overlap, skip_comm=skip)
            print_header(row)
            row.update(print_result(result, bench.batch_size, bench.input_len,
                                    bench.output_len))
            timings[overlap, skip] = (result.latencies(), row)
    rows = []
    exposed = {}
    for overlap in ("off", "on"):
        (prefill, decode), row = timings[overlap, False]
        (prefill_skip, decode_skip), _ = timings[overlap, True]
        exposed_prefill, exposed_decode = prefill - prefill_skip, decode - decode_skip
        exposed[overlap] = (exposed_prefill, exposed_decode)
        row.update(prefill_latency_skip_comm=prefill_skip,
                   median_decode_latency_skip_comm=decode_skip,
                   exposed_comm_prefill=exposed_prefill, exposed_comm_decode=exposed_decode,
                   exposed_share_prefill=exposed_prefill / prefill,
                   exposed_share_decode=exposed_decode / decode if decode else 0.0)
        rows.append(row)
    off, on = rows
    phases = [("prefill", 0), ("decode", 1)] if bench.output_len > 1 else [("prefill", 0)]
    for phase, i in phases:
        base = exposed["off"][i]
        on[f"overlap_efficiency_{phase}"] = 1 - exposed["on"][i] / base if base > 0 else None
    on["prefill_speedup"] = off["prefill_latency"] / on["prefill_latency"]
    if bench.output_len > 1:
        on["decode_speedup"] = off["median_decode_latency"] / on["median_decode_latency"]
    print("\nExposed communication (T - T_skip_comm):")
    for phase, _ in phases:
        eff = on[f"overlap_efficiency_{phase}"]
        print(f"  {phase:7s}: off {off[f'exposed_comm_{phase}'] * 1e3:8.2f} ms "
              f"({off[f'exposed_share_{phase}']:6.1%} of the step), "
              f"on {on[f'exposed_comm_{phase}'] * 1e3:8.2f} ms "
              f"({on[f'exposed_share_{phase}']:6.1%}); overlap efficiency "
              f"{'n/a' if eff is None else f'{eff:.1%}'}; on/off throughput "
              f"{on[f'{phase}_speedup']:.3f}x")
    return rows


def _crossover(points: list[dict]) -> int:
    """Smallest token count from which overlap wins at every measured point (or beyond all)."""
    ordered = sorted(points, key=lambda p: p["tokens"])
    threshold = ordered[-1]["tokens"] + 1
    for point in reversed(ordered):
        if point["on"] < point["off"]:
            threshold = point["tokens"]
        else:
            break
    return threshold


def run_overlap_sweep(engine: EngineConfig, bench: OneBatch, config: ModelConfig) -> list[dict]:
    """Overlap off/on/auto over batch sizes for prefill and decode, on one launch.

    At each point the three modes run back to back (auto learned, or the `--overlap-min-tokens`
    rule where given), so the comparison is not skewed by the host drifting between passes; the
    crossover found over all points is printed as the threshold to set."""
    sizes = [int(b) for b in bench.sweep_batch_sizes.split(",")]
    workload = BraidWorkload(engine, max(sizes), bench.input_len, bench.output_len)
    min_tokens = workload.llm.config.switches.overlap_min_tokens  # None: auto learns
    points = []
    try:
        for bs in sizes:
            prompts = random_prompts(bs, bench.input_len, config.vocab_size)
            timed(workload, prompts, min(bench.output_len, 4), 1)  # warm this shape up
            best = fastest_by_mode(workload, prompts, bench.output_len, bench.repeat, "overlap",
                                   ["off", "on", "auto"])
            for kind, i, tokens in (("prefill", 0, bs * bench.input_len), ("decode", 1, bs)):
                points.append({"kind": kind, "batch_size": bs, "tokens": tokens,
                               **{mode: best[mode][i] for mode in ("off", "on", "auto")}})
            print(f"batch {bs:4d}: " + "; ".join(
                f"{p['kind']} off {p['off']:.4f} s on {p['on']:.4f} s auto {p['auto']:.4f} s"
                for p in points[-2:]), flush=True)
    finally:
        workload.close()
    threshold = _crossover(points)
    print(f"\nOverlap sweep: tp={engine.parallel.tp} comm={engine.parallel.comm} "
          f"dtype={engine.dtype} "
          f"input_len={bench.input_len} overlap_min_tokens={min_tokens} "
          f"(prefill step / median decode step, fastest of {bench.repeat})")
    print(f"{'kind':>8} {'batch':>6} {'tokens':>7} | {'off s':>9} {'on s':>9} {'on/off':>7} | "
          f"{'auto s':>9} {'auto/best':>9}")
    rows = []
    for p in points:
        best_time = min(p["on"], p["off"])
        print(f"{p['kind']:>8} {p['batch_size']:6d} {p['tokens']:7d} | {p['off']:9.4f} "
              f"{p['on']:9.4f} {p['off'] / p['on']:6.3f}x | {p['auto']:9.4f} "
              f"{p['auto'] / best_time:8.3f}x")
        rows.append(base_row(engine, bench, **p, overlap_min_tokens=min_tokens,
                             crossover_tokens=threshold, auto_over_best=p["auto"] / best_time))
    print(f"\ncrossover: overlap pays from {threshold} tokens per step here; "
          f"set --overlap-min-tokens {threshold} (with --overlap auto)")
    append_rows(bench.result_file, rows)
    return rows
