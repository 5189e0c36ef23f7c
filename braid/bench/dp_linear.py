"""DP linear measurements.

- `braid bench-one-batch --compare-dp-linear off,on`: whole prefill and decode steps with each
  `--dp-linear` mode, alternating in one launch (the mode is a per-step setting).
- `braid bench-dp-linear`: the fused replicated projection alone (DeepSeek's q_a + kv_a), per
  rank: the replicated GEMM over all tokens vs `DataParallelLinear` (1/tp of the tokens, then
  the all-gather), at several token counts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from braid.bench.harness import (
    BraidWorkload,
    OneBatch,
    append_rows,
    base_row,
    fastest_by_mode,
    timed,
)
from braid.config import (
    DTYPES,
    SWITCH_CHOICES,
    EngineConfig,
    ParallelConfig,
    resolve_comm,
    resolve_dtype,
)
from braid.distributed.comm import TorchCommunicator
from braid.distributed.ranks.local import LocalRankGroup
from braid.distributed.shm import ShmCommunicator, ShmSegment, activation_slot_bytes
from braid.errors import UserError
from braid.layers.linear import DataParallelLinear
from braid.loader.model_config import load_model_config
from braid.platform import usable_cores


def compare_dp_linear(engine: EngineConfig, bench: OneBatch, workload: BraidWorkload,
                      prompts: np.ndarray) -> list[dict]:
    """Each mode of `--compare-dp-linear` timed `--repeat` times, modes alternating; the
    fastest prefill and fastest median decode step of each mode count."""
    modes = bench.compare_dp_linear.split(",")
    bad = [m for m in modes if m not in SWITCH_CHOICES]
    if bad or len(modes) < 2:
        raise UserError(f"--compare-dp-linear takes two or more of "
                        f"{', '.join(SWITCH_CHOICES)}, comma-separated; got "
                        f"{bench.compare_dp_linear!r}")
    for mode in modes:
        timed(workload, prompts, min(bench.output_len, 4), 0, dp_linear=mode)  # warm-up
    best = fastest_by_mode(workload, prompts, bench.output_len, bench.repeat, "dp_linear", modes)
    bs, tokens = bench.batch_size, bench.batch_size * bench.input_len
    first = modes[0]
    print(f"\nDP linear: tp={engine.parallel.tp} comm={engine.parallel.comm} "
          f"dtype={engine.dtype} batch_size={bs} "
          f"input_len={bench.input_len} output_len={bench.output_len} "
          f"dp_linear_min_tokens={workload.llm.config.switches.dp_linear_min_tokens} "
          f"cores={len(usable_cores())} "
          f"(fastest of {bench.repeat})")
    print(f"{'mode':>5} | {'prefill s':>10} {'tok/s':>9} {'x ' + first:>8} | "
          f"{'decode s':>9} {'tok/s':>8} {'x ' + first:>8}")
    rows = []
    for mode in modes:
        prefill, decode = best[mode]
        prefill_x = best[first][0] / prefill
        line = f"{mode:>5} | {prefill:10.4f} {tokens / prefill:9.1f} {prefill_x:7.3f}x | "
        if bench.output_len > 1:
            decode_x, decode_tps = best[first][1] / decode, bs / decode
            line += f"{decode:9.4f} {decode_tps:8.1f} {decode_x:7.3f}x"
        else:
            decode = decode_x = decode_tps = None
            line += f"{'-':>9} {'-':>8} {'-':>8}"
        print(line)
        rows.append(base_row(engine, bench, dp_linear=mode, prefill_latency=prefill,
                             prefill_throughput=tokens / prefill, median_decode_latency=decode,
                             median_decode_throughput=decode_tps,
                             prefill_speedup_vs_first=prefill_x,
                             decode_speedup_vs_first=decode_x))
    return rows


def _median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dp_linear_worker(rank: int, world_size: int, conn, hidden: int, out_sizes: list[int],
                     dtype: str, token_counts: list[int], repeat: int,
                     segment: ShmSegment | None) -> None:
    """Rank entry point: time both forms at every token count; rank 0 answers the rows."""
    timeout_s = ParallelConfig().comm_timeout_s  # the engine's default
    comm = (ShmCommunicator(rank, segment, timeout_s) if segment is not None
            else TorchCommunicator(rank, world_size))
    layer = DataParallelLinear(hidden, out_sizes, comm, shard_ids=list(range(len(out_sizes))),
                               dtype=DTYPES[dtype])
    torch.manual_seed(0)
    layer.weight.data.normal_(0.0, hidden ** -0.5)
    rows = []
    with torch.inference_mode():
        for tokens in token_counts:
            x = torch.randn(tokens, hidden).to(DTYPES[dtype])
            replicated = _median_seconds(lambda x=x: layer(x), repeat)
            split = _median_seconds(
                lambda x=x: layer.wait(layer.forward_async(x), x.shape[0]), repeat)
            per_rank = comm.all_gather(torch.tensor([[replicated, split]], dtype=torch.float64))
            slowest = per_rank.max(dim=0).values.tolist()
            rows.append({"tokens": tokens, "replicated_s": slowest[0], "dp_linear_s": slowest[1],
                         "ratio": slowest[1] / slowest[0], "per_rank": per_rank.tolist()})
    if segment is not None:
        comm.close()
    conn.send(("ok", rows))
    conn.recv()


def run_bench_dp_linear(args: argparse.Namespace) -> list[dict]:
    """Run the micro-benchmark as the CLI flags say; print the table; append JSONL rows."""
    config = load_model_config(args.model)
    extra = config.extra
    if "kv_lora_rank" not in extra:
        raise UserError(f"{args.model} has no replicated MLA projection (not a DeepSeek model)")
    if args.tp < 2:
        raise UserError("bench-dp-linear needs --tp 2 or more")
    token_counts = [int(t) for t in args.tokens.split(",")]
    out_sizes = [s for s in (extra.get("q_lora_rank"),
                             extra["kv_lora_rank"] + extra["qk_rope_head_dim"]) if s]
    dtype = resolve_dtype(args.dtype)
    comm = resolve_comm() if args.comm == "auto" else args.comm
    segment = None
    if comm == "shm":
        segment = ShmSegment.create(args.tp, slot_bytes=activation_slot_bytes(
            max(token_counts), sum(out_sizes), DTYPES[dtype].itemsize))
    group = LocalRankGroup(args.tp, dp_linear_worker,
                      (config.hidden_size, out_sizes, dtype, token_counts, args.repeat, segment),
                      cleanup=segment.unlink if segment else None)
    try:
        rows = group.recv(0)
    finally:
        group.close()
    print(f"Fused replicated projection {config.hidden_size} -> {' + '.join(map(str, out_sizes))}"
          f": tp={args.tp} comm={comm} dtype={dtype} cores={len(usable_cores())} "
          f"(median of {args.repeat}; slowest rank)")
    print(f"{'tokens':>7} | {'replicated ms':>13} | {'dp linear ms':>12} | {'dp/replicated':>13}")
    for row in rows:
        print(f"{row['tokens']:7d} | {row['replicated_s'] * 1e3:13.2f} | "
              f"{row['dp_linear_s'] * 1e3:12.2f} | {row['ratio']:12.3f}x")
        row.update(model=args.model, tp=args.tp, comm=comm, dtype=dtype,
                   cores=len(usable_cores()))
    append_rows(args.result_file, rows)
    return rows
