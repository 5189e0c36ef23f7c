"""Plots of benchmark and evaluation results (matplotlib, headless).

`plot_results` (`braid plot`): bar charts across the rows of bench-one-batch, bench-serving /
bench-offline and eval-mmlu JSONL files, one panel per metric, each bar labelled by the settings
that differ between the rows (overlap off/on, comm torch/shm, braid/hf, a `--tag`, ...), so a
comparison reads at a glance. `plot_serving_run` (`bench-serving --plot`): one run's TTFT and
ITL distributions and its output tokens per second over time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from braid.errors import UserError

# Per kind of result: how to recognise a row, the settings that tell rows apart, the metrics.
KINDS = {
    "bench-one-batch": (
        lambda row: "prefill_throughput" in row,
        ["tag", "backend", "tp", "dtype", "comm", "overlap", "dp_linear", "skip_comm",
         "batch_size", "input_len", "output_len"],
        [("prefill_throughput", "prefill tok/s"),
         ("median_decode_throughput", "decode tok/s (median step)")]),
    "bench-serving": (
        lambda row: "output_throughput" in row,
        ["tag", "backend", "tp", "dataset_name", "num_prompts", "random_input_len",
         "random_output_len", "request_rate", "max_concurrency"],
        [("output_throughput", "output tok/s"), ("input_throughput", "input tok/s"),
         ("mean_ttft_ms", "mean TTFT ms"), ("p99_ttft_ms", "P99 TTFT ms"),
         ("median_itl_ms", "median ITL ms"), ("p99_itl_ms", "P99 ITL ms")]),
    "eval-mmlu": (
        lambda row: row.get("eval") == "mmlu",
        ["tag", "backend", "tp", "comm", "overlap", "dp_linear", "dtype", "num_shots", "limit"],
        [("micro_accuracy", "accuracy (micro)"), ("macro_accuracy", "accuracy (macro)"),
         ("questions_per_s", "questions / s")]),
}


def _kind(row: dict) -> str | None:
    for name in ("eval-mmlu", "bench-one-batch", "bench-serving"):
        if KINDS[name][0](row):
            return name
    return None


def read_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        if not Path(path).is_file():
            raise UserError(f"no such result file: {path}")
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    raise UserError(f"{path}:{number} is not a JSON line") from None
    return rows


SHORT_NAMES = {"max_concurrency": "conc", "request_rate": "rate", "random_input_len": "in",
               "random_output_len": "out", "dataset_name": "data", "num_prompts": "prompts",
               "dp_linear": "dp", "batch_size": "bs", "input_len": "in", "output_len": "out"}


def labels(rows: list[dict], keys: list[str]) -> list[str]:
    """Each row's label: the settings whose values differ between the rows that have them (or
    the first setting, when all rows agree), one per line."""
    def differs(key: str) -> bool:
        return len({json.dumps(r[key]) for r in rows if r.get(key) is not None}) > 1

    shown = [k for k in keys if differs(k)] or [k for k in keys if k in rows[0]][:1]
    def setting(key: str, value) -> str:
        return str(value) if key == "tag" else f"{SHORT_NAMES.get(key, key)}={value}"

    return ["\n".join(setting(k, r[k]) for k in shown if r.get(k) is not None) for r in rows]


COLUMNS = 3


def plot_results(paths: list[str], out: str) -> list[str]:
    """Bar charts of every kind of result in the files, three panels a line; the kinds
    plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict]] = {}
    for row in read_rows(paths):
        kind = _kind(row)
        if kind is not None:
            groups.setdefault(kind, []).append(row)
    if not groups:
        raise UserError("no bench-one-batch, bench-serving or eval-mmlu rows in the files")
    panels = [(kind, metric) for kind in groups for metric in KINDS[kind][2]]
    lines = sum(math.ceil(len(KINDS[kind][2]) / COLUMNS) for kind in groups)
    width = max(5.0, 0.95 * max(len(rows) for rows in groups.values()))  # room per label
    fig, axes = plt.subplots(lines, COLUMNS, squeeze=False,
                             figsize=(width * COLUMNS, 4.2 * lines))
    slots = iter(axes.flat)
    for kind, rows in groups.items():
        _, keys, metrics = KINDS[kind]
        names = labels(rows, keys)
        used = [next(slots) for _ in range(math.ceil(len(metrics) / COLUMNS) * COLUMNS)]
        for ax, (metric, title) in zip(used, metrics):
            values = [row.get(metric, math.nan) for row in rows]
            bars = ax.bar(range(len(rows)), values, color=[f"C{i}" for i in range(len(rows))])
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
            ax.set_title(f"{kind}: {title}", fontsize=10)
            ax.set_xticks(range(len(rows)), names, fontsize=7)
        for ax in used[len(metrics):]:
            ax.axis("off")
    assert len(panels) <= lines * COLUMNS
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return list(groups)


def plot_serving_run(results, out: str, title: str) -> None:
    """One bench-serving run: TTFT and ITL histograms, output tokens per second over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.success]
    if not ok:
        raise UserError("no request succeeded: nothing to plot")
    fig, (ttft, itl, rate) = plt.subplots(1, 3, figsize=(13, 3.8))
    ttft.hist([r.ttft * 1000 for r in ok], bins=30)
    ttft.set(title="TTFT", xlabel="ms", ylabel="requests")
    gaps = [g * 1000 for r in ok for g in r.itl]
    itl.hist(gaps or [0.0], bins=50, log=True)
    itl.set(title="inter-token latency", xlabel="ms", ylabel="chunks")
    origin = min(r.start_time for r in ok)
    times = np.concatenate([r.start_time - origin + r.ttft + np.cumsum([0.0, *r.itl])
                            for r in ok])
    rate.hist(times, bins=np.arange(0, math.ceil(times.max()) + 1))
    rate.set(title="output chunks per second", xlabel="s since the first request")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
