"""Overlap measurements of `braid bench-one-batch`, each in one launch (settings switch per step).

- `--measure-exposed`: overlap off and on, each with and without collectives
  (`exposed = T - T_skip_comm`), and the overlap efficiency `1 - exposed_on / exposed_off`.
- `--overlap-sweep`: overlap off and on over batch sizes, for prefill and decode; prints the
  token count from which overlap pays (the `--overlap-min-tokens` to set) and checks `auto`
  with that threshold against the better of the two at every point.
"""

from __future__ import annotations

import argparse

import numpy as np

from braid.bench.one_batch import (
    BenchResult,
    BraidWorkload,
    append_rows,
    base_row,
    print_header,
    print_result,
    random_prompts,
    timed,
)


def _latencies(result: BenchResult) -> tuple[float, float]:
    """(prefill latency, median decode latency)."""
    return result.prefill_latency, float(np.median(result.decode_latencies or [0.0]))


def measure_exposed(args: argparse.Namespace, workload: BraidWorkload,
                    prompts: np.ndarray) -> list[dict]:
    """Overlap off/on x with/without collectives on one launch; rows for off and on."""
    timings = {}
    for overlap in ("off", "on"):
        for skip in (False, True):
            result = timed(workload, prompts, args.output_len, args.warmup, overlap=overlap,
                           skip_comm=skip)
            row = base_row(args, overlap=overlap, skip_comm=skip)
            print_header(row)
            row.update(print_result(result, args.batch_size, args.input_len, args.output_len))
            timings[overlap, skip] = (_latencies(result), row)
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
    for phase, i in (("prefill", 0), ("decode", 1)):
        base = exposed["off"][i]
        on[f"overlap_efficiency_{phase}"] = 1 - exposed["on"][i] / base if base > 0 else None
    on["prefill_speedup"] = off["prefill_latency"] / on["prefill_latency"]
    on["decode_speedup"] = off["median_decode_latency"] / on["median_decode_latency"]
    print("\nExposed communication (T - T_skip_comm):")
    for phase, key in (("prefill", "prefill"), ("decode", "decode")):
        eff = on[f"overlap_efficiency_{phase}"]
        print(f"  {phase:7s}: off {off[f'exposed_comm_{key}'] * 1e3:8.2f} ms "
              f"({off[f'exposed_share_{key}']:6.1%} of the step), "
              f"on {on[f'exposed_comm_{key}'] * 1e3:8.2f} ms "
              f"({on[f'exposed_share_{key}']:6.1%}); overlap efficiency "
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


def run_overlap_sweep(args: argparse.Namespace, config) -> list[dict]:
    """Overlap off/on/auto over batch sizes for prefill and decode, on one launch."""
    sizes = [int(b) for b in args.sweep_batch_sizes.split(",")]
    workload = BraidWorkload(args, max(sizes), args.input_len, args.output_len)
    llm = workload.llm
    points = []
    try:
        for bs in sizes:
            prompts = random_prompts(bs, args.input_len, config.vocab_size)
            timed(workload, prompts, min(args.output_len, 4), 1)  # warm this shape up
            lat = {mode: min((_latencies(workload.run(prompts, args.output_len, overlap=mode))
                              for _ in range(args.repeat)), key=lambda t: t[0] + t[1])
                   for mode in ("off", "on")}
            points.append({"kind": "prefill", "batch_size": bs, "tokens": bs * args.input_len,
                           "off": lat["off"][0], "on": lat["on"][0]})
            points.append({"kind": "decode", "batch_size": bs, "tokens": bs,
                           "off": lat["off"][1], "on": lat["on"][1]})
            print(f"batch {bs:4d}: prefill off {lat['off'][0]:.4f} s on {lat['on'][0]:.4f} s; "
                  f"decode off {lat['off'][1] * 1e3:.2f} ms on {lat['on'][1] * 1e3:.2f} ms",
                  flush=True)
        threshold = _crossover(points)
        llm.overlap_min_tokens = threshold
        for bs in sizes:
            prompts = random_prompts(bs, args.input_len, config.vocab_size)
            auto = min((_latencies(workload.run(prompts, args.output_len, overlap="auto"))
                        for _ in range(args.repeat)), key=lambda t: t[0] + t[1])
            for point in points:
                if point["batch_size"] == bs:
                    point["auto"] = auto[0] if point["kind"] == "prefill" else auto[1]
    finally:
        workload.close()
    print(f"\nOverlap sweep: tp={args.tp} comm={args.comm} dtype={args.dtype} "
          f"input_len={args.input_len} (latency of the prefill step / median decode step)")
    print(f"{'kind':>8} {'batch':>6} {'tokens':>7} | {'off s':>9} {'on s':>9} {'on/off':>7} | "
          f"{'auto s':>9} {'auto/best':>9}")
    rows = []
    for p in points:
        best = min(p["on"], p["off"])
        print(f"{p['kind']:>8} {p['batch_size']:6d} {p['tokens']:7d} | {p['off']:9.4f} "
              f"{p['on']:9.4f} {p['off'] / p['on']:6.3f}x | {p['auto']:9.4f} "
              f"{p['auto'] / best:8.3f}x")
        rows.append(base_row(args, **p, overlap_min_tokens=threshold,
                             auto_over_best=p["auto"] / best))
    print(f"\ncrossover: overlap pays from {threshold} tokens per step here; "
          f"set --overlap-min-tokens {threshold} (with --overlap auto)")
    append_rows(args.result_file, rows)
    return rows
