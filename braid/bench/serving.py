"""`braid bench-serving`: SGLang's bench_serving, against any OpenAI-compatible server.

Requests (see `braid.bench.datasets`) arrive as a Poisson process at `--request-rate` (all at
once for `inf`), at most `--max-concurrency` in flight, each a streamed `/v1/completions` call
with `ignore_eos` so outputs have the requested lengths. Per request: TTFT (to the first chunk
with text), ITL (between chunks with text), TPOT = (latency - TTFT) / (tokens - 1), E2E latency.
The result block and the JSON line use SGLang's labels and key names; failed requests are
counted and the first error printed, never dropped. Against a braid server, the steps the run
caused are counted by the path they took (`/metrics`: compiled decode graph, compiled pieces,
eager), so a figure never silently comes from the slow path, and a server decoding
speculatively reports how many proposed tokens the run's steps accepted.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import traceback
from dataclasses import dataclass, field, replace

import httpx
import numpy as np
from tqdm import tqdm

from braid.bench.client import auth_headers, discover_model, load_bench_tokenizer
from braid.bench.datasets import BenchRequest, Dataset, sample_requests
from braid.errors import UserError
from braid.settings import check, setting

BACKENDS = ("braid", "sglang-oai", "vllm", "openai")
PERCENTILES = (90, 95, 99)
# `--preset concurrency-table`: the runs of the tensor-parallel comparison (docs/performance.md),
# (prompts, concurrency) of random ids, 256 in and 64 out, exact lengths
CONCURRENCY_TABLE = ((16, 1), (64, 32))


@dataclass(frozen=True)
class ServingConfig:
    """What `bench-serving` runs (its flags, SGLang's names and defaults)."""

    base_url: str = setting("http://127.0.0.1:30000", "the server to benchmark")
    backend: str = setting("braid", "openai: no ignore_eos in the requests", choices=BACKENDS)
    model: str | None = setting(None, "default: the server's first model")
    tokenizer: str | None = setting(
        None, "local GGUF file or model folder (default: the path the server reports for its "
        "model)")
    dataset: Dataset = field(default_factory=Dataset)
    request_rate: float = setting(
        float("inf"), "requests per second, Poisson arrivals (inf: all at once)")
    max_concurrency: int | None = setting(None, "most requests in flight", at_least=1)
    extra_request_body: str | None = setting(
        None, "a JSON object merged into every request's body (SGLang's flag), e.g. "
        "'{\"response_format\": {...}}'", metavar="JSON")
    tokenize_prompt: bool = setting(
        False, "send token ids instead of text, so prompt lengths are exact")
    warmup_requests: int = setting(1, "requests sent before the timed ones", at_least=0)
    plot: str | None = setting(
        None, "plot this run: TTFT and ITL distributions, output over time", metavar="F.png")
    disable_tqdm: bool = setting(False, "no progress bar")
    output_file: str | None = setting(None, "append one JSON line here")
    output_details: bool = setting(
        False, "the JSON line also lists each request's input and output lengths, TTFT, ITLs, "
        "decode rate, text and error (SGLang's keys, and decode_rates), in request order")
    baseline_file: str | None = setting(
        None, "a JSON line file whose last line is an --output-details run of the same "
        "requests (same dataset and seed) against another server: print each request's "
        "decode rate against it (ratios, their median and least) and how many texts match",
        metavar="F.jsonl")
    tag: str | None = setting(None, "a label for this run in the JSON line (and in braid plot)")
    preset: str | None = setting(
        None, "concurrency-table: instead of one run, 16 random-id prompts of 256 tokens (64 "
        "out) at concurrency 1, then 64 at 32, and one markdown row of output tok/s and mean "
        "ITL at each (the dataset flags are set for it)", choices=("concurrency-table",))
    timeout_s: float = 3600.0  # one request's longest wait

    def __post_init__(self) -> None:
        check(self)
        if not self.request_rate > 0:
            raise UserError("--request-rate must be > 0 (or inf)")
        _ = self.extra_body  # a bad --extra-request-body fails before any request is sent

    @property
    def extra_body(self) -> dict:
        """--extra-request-body as a dict ({} when absent)."""
        if self.extra_request_body is None:
            return {}
        try:
            value = json.loads(self.extra_request_body)
        except json.JSONDecodeError as e:
            raise UserError(f"--extra-request-body: not JSON: {e}") from None
        if not isinstance(value, dict):
            raise UserError("--extra-request-body: expected a JSON object")
        return value


@dataclass
class RequestResult:
    """What one request measured (times in seconds from its own start)."""

    prompt_len: int
    output_len: int = 0
    success: bool = False
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


async def send_request(client: httpx.AsyncClient, url: str, model: str, backend: str,
                       request: BenchRequest, tokenize_prompt: bool,
                       extra: dict | None = None) -> RequestResult:
    """One streamed completion (its body plus `extra`); its timings, text and reported token
    count."""
    payload = {"model": model,
               "prompt": request.prompt_ids if tokenize_prompt else request.prompt,
               "temperature": 0.0, "max_tokens": request.output_len, "stream": True,
               "stream_options": {"include_usage": True}}
    if backend != "openai":
        payload["ignore_eos"] = True
    payload.update(extra or {})
    result = RequestResult(request.prompt_len)
    start = time.perf_counter()
    result.start_time = start
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=auth_headers()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            usage = None
            async for line in response.aiter_lines():
                line = line.strip()
                if not line:
                    continue
                now = time.perf_counter()
                result.latency = now - start
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                usage = chunk.get("usage") or usage
                text = chunk["choices"][0].get("text") if chunk.get("choices") else None
                if text:
                    if not result.generated_text:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.generated_text += text
            result.output_len = (usage or {}).get("completion_tokens", request.output_len)
            result.success = True
    except Exception:  # noqa: BLE001 - a failed request is counted and reported, not fatal
        result.error = traceback.format_exc(limit=2)
    return result


async def _arrivals(requests: list[BenchRequest], rate: float):
    """Requests at Poisson arrival times (exponential gaps at `rate` per second)."""
    for request in requests:
        yield request
        if rate != float("inf"):
            await asyncio.sleep(np.random.exponential(1.0 / rate))


async def run_requests(config: ServingConfig, model: str,
                       requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Warm up, then run every request; the results and the benchmark's duration."""
    url = f"{config.base_url}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as client:
        if config.warmup_requests:
            print(f"Starting warmup with {config.warmup_requests} sequences...")
            first = requests[0]
            warm = BenchRequest(first.prompt, first.prompt_ids, min(first.output_len, 32))
            results = await asyncio.gather(*(
                send_request(client, url, model, config.backend, warm, config.tokenize_prompt,
                             config.extra_body)
                for _ in range(config.warmup_requests)))
            if not any(r.success for r in results):
                raise UserError(f"warm-up failed; check the flags. Error: {results[0].error}")
            print(f"Warmup completed with {config.warmup_requests} sequences. "
                  "Starting main benchmark run...")
            await asyncio.sleep(1.0)
        semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency \
            else None
        progress = None if config.disable_tqdm else tqdm(total=len(requests))

        async def limited(request: BenchRequest) -> RequestResult:
            if semaphore is None:
                result = await send_request(client, url, model, config.backend, request,
                                            config.tokenize_prompt, config.extra_body)
            else:
                async with semaphore:
                    result = await send_request(client, url, model, config.backend, request,
                                                config.tokenize_prompt,
                                                config.extra_body)
            if progress is not None:
                progress.update(1)
            return result

        start = time.perf_counter()
        tasks = [asyncio.create_task(limited(r))
                 async for r in _arrivals(requests, config.request_rate)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if progress is not None:
            progress.close()
    return list(results), duration


def compute_metrics(results: list[RequestResult], duration: float, tokenizer) -> dict:
    """SGLang's metrics (see the module docstring), with p90/p95/p99 of every latency."""
    ok = [r for r in results if r.success]
    output_lens = [r.output_len for r in ok]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(output_lens)
    retokenized = sum(len(tokenizer.encode(r.generated_text, add_special_tokens=False))
                      for r in ok)
    e2e = [r.latency for r in ok]
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    metrics = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "total_output_tokens_retokenized": retokenized,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_input / duration,
        "output_throughput": total_output / duration,
        "total_throughput": (total_input + total_output) / duration,
    }
    for name, values in (("e2e_latency", e2e), ("ttft", ttfts), ("tpot", tpots),
                         ("itl", itls)):
        data = np.array(values or [0.0]) * 1000
        metrics[f"mean_{name}_ms"] = float(data.mean())
        metrics[f"median_{name}_ms"] = float(np.median(data))
        metrics[f"std_{name}_ms"] = float(data.std())
        for p in PERCENTILES:
            metrics[f"p{p}_{name}_ms"] = float(np.percentile(data, p))
        metrics[f"max_{name}_ms"] = float(data.max())
    metrics["concurrency"] = sum(e2e) / duration
    metrics["max_output_tokens_per_s"], metrics["max_concurrent_requests"] = _peaks(ok)
    return metrics


def decode_rate(result: RequestResult) -> float | None:
    """A request's output tokens per second after its first (None: failed, or one token)."""
    if not result.success or result.output_len < 2 or result.latency <= result.ttft:
        return None
    return (result.output_len - 1) / (result.latency - result.ttft)


def request_details(results: list[RequestResult]) -> dict:
    """Per-request lists, in request order (`--output-details`)."""
    return {"input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_len for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "decode_rates": [decode_rate(r) for r in results],
            "generated_texts": [r.generated_text for r in results],
            "errors": [r.error for r in results]}


def load_baseline(baseline_file: str, requests: list[BenchRequest]) -> dict:
    """The last line of `baseline_file`: a run with --output-details of these requests."""
    try:
        with open(baseline_file) as f:
            rows = [json.loads(text) for text in f if text.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--baseline-file {baseline_file}: {e}") from None
    if not rows or "decode_rates" not in rows[-1]:
        raise UserError(f"--baseline-file {baseline_file}: its last line is not a run with "
                        "--output-details")
    if rows[-1]["input_lens"] != [r.prompt_len for r in requests]:
        raise UserError(f"--baseline-file {baseline_file}: its requests are not these (other "
                        "prompt lengths: use the same dataset, lengths and --seed)")
    return rows[-1]


def compare_to_baseline(details: dict, baseline: dict) -> dict:
    """Each request's decode rate over the baseline run's (`load_baseline`) for the same
    request, their median and least, and how many texts are identical; printed and
    returned."""
    ratios = [mine / theirs for mine, theirs in zip(details["decode_rates"],
                                                     baseline["decode_rates"])
              if mine is not None and theirs]
    same = sum(a == b for a, b in zip(details["generated_texts"], baseline["generated_texts"]))
    comparison = {"decode_rate_ratios": ratios,
                  "median_decode_rate_ratio": float(np.median(ratios)) if ratios else None,
                  "min_decode_rate_ratio": min(ratios, default=None),
                  "texts_identical": same}
    print("{s:{c}^{n}}".format(s=" Against the baseline ", n=50, c="-"))
    line("Decode-rate ratios, per request:", " ".join(f"{r:.2f}" for r in ratios) or "none")
    if ratios:
        line("Median decode-rate ratio:", comparison["median_decode_rate_ratio"])
        line("Least decode-rate ratio:", comparison["min_decode_rate_ratio"])
    line("Texts identical:", f"{same} of {len(details['generated_texts'])}")
    return comparison


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """Peak output chunks in any one-second bucket, and peak requests in flight (SGLang's
    per-second buckets)."""
    if not ok:
        return 0.0, 0
    origin = min(r.start_time for r in ok)
    seconds = int(np.ceil(max(r.start_time + r.latency for r in ok) - origin)) + 1
    tokens, active = np.zeros(seconds), np.zeros(seconds)
    for r in ok:
        times = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        np.add.at(tokens, (times - origin).astype(int), 1)
        first, last = int(r.start_time - origin), int(r.start_time + r.latency - origin)
        active[first:min(last, seconds - 1) + 1] += 1
    return float(tokens.max()), int(active.max())


def line(label: str, value) -> None:
    """One line of a result block, as SGLang formats it."""
    spec = "{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}"
    print(spec.format(label, value))


def print_result(config: ServingConfig, metrics: dict) -> None:
    """SGLang's "Serving Benchmark Result" block, with p90/p95 lines and max values added."""
    def section(title: str, name: str, label: str) -> None:
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        line(f"Mean {label} (ms):", metrics[f"mean_{name}_ms"])
        line(f"Median {label} (ms):", metrics[f"median_{name}_ms"])
        for p in PERCENTILES:
            line(f"P{p} {label} (ms):", metrics[f"p{p}_{name}_ms"])
        line(f"Max {label} (ms):", metrics[f"max_{name}_ms"])

    print("\n{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Backend:", config.backend)
    line("Traffic request rate:", config.request_rate)
    line("Max request concurrency:", config.max_concurrency or "not set")
    line("Successful requests:", metrics["completed"])
    line("Failed requests:", metrics["failed"])
    line("Benchmark duration (s):", metrics["duration"])
    line("Total input tokens:", metrics["total_input_tokens"])
    line("Total generated tokens:", metrics["total_output_tokens"])
    line("Total generated tokens (retokenized):", metrics["total_output_tokens_retokenized"])
    line("Request throughput (req/s):", metrics["request_throughput"])
    line("Input token throughput (tok/s):", metrics["input_throughput"])
    line("Output token throughput (tok/s):", metrics["output_throughput"])
    line("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"])
    line("Peak concurrent requests:", metrics["max_concurrent_requests"])
    line("Total token throughput (tok/s):", metrics["total_throughput"])
    line("Concurrency:", metrics["concurrency"])
    if "steps_by_path" in metrics:  # a braid server's steps during the run (warm-up included)
        line("Engine steps by path:", ", ".join(
            f"{path} {count}" for path, count in metrics["steps_by_path"].items()) or "none")
    if metrics.get("spec_draft_tokens"):
        line("Speculative draft tokens:", metrics["spec_draft_tokens"])
        line("Speculative accepted tokens:", metrics["spec_accepted_tokens"])
        line("Speculative acceptance rate:", metrics["spec_acceptance_rate"])
    section("End-to-End Latency", "e2e_latency", "E2E Latency")
    section("Time to First Token", "ttft", "TTFT")
    section("Time per Output Token (excl. 1st token)", "tpot", "TPOT")
    section("Inter-Token Latency", "itl", "ITL")
    print("=" * 50)


_STEP_PATH_LINE = re.compile(r'^braid:engine_steps_by_path_total\{path="([^"]+)"\} (\S+)$')
_SPEC_LINE = re.compile(r"^braid:spec_decode_num_(draft|accepted)_tokens_total (\S+)$")


def server_counts(base_url: str) -> dict[str, float] | None:
    """A braid server's totals so far (`/metrics`): steps by path (`path:<name>` keys) and
    speculative decoding's draft and accepted tokens; None for other servers."""
    try:
        with httpx.Client(timeout=10) as client:
            response = client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or "braid:engine_steps" not in response.text:
        return None
    counts = {}
    for line in response.text.splitlines():
        if match := _STEP_PATH_LINE.match(line):
            counts[f"path:{match.group(1)}"] = float(match.group(2))
        elif match := _SPEC_LINE.match(line):
            counts[match.group(1)] = float(match.group(2))
    return counts


def run_counts(before: dict[str, float], after: dict[str, float]) -> dict:
    """What a run added to a braid server's totals, as `metrics` entries."""
    added = {key: int(value - before.get(key, 0)) for key, value in sorted(after.items())}
    drafted, accepted = added.get("draft", 0), added.get("accepted", 0)
    return {"steps_by_path": {key.removeprefix("path:"): count
                              for key, count in added.items()
                              if key.startswith("path:") and count > 0},
            "spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else None}


def run_concurrency_table(config: ServingConfig) -> list[dict]:
    """`--preset concurrency-table`: the `CONCURRENCY_TABLE` runs, one after the other, then
    their row of the comparison table (the server named by `--tag`, else its URL)."""
    rows = []
    for prompts, concurrency in CONCURRENCY_TABLE:
        dataset = replace(config.dataset, dataset_name="random-ids", num_prompts=prompts,
                          random_input_len=256, random_output_len=64, random_range_ratio=1.0)
        rows.append(run_bench_serving(replace(
            config, preset=None, dataset=dataset, max_concurrency=concurrency,
            request_rate=float("inf"), tokenize_prompt=True)))
    cells = [f"{row['output_throughput']:.1f} | {row['mean_itl_ms']:.1f} ms" for row in rows]
    header = " | ".join(f"C {c} out tok/s | C {c} mean ITL" for _, c in CONCURRENCY_TABLE)
    print(f"\n| server | {header} |\n|---|{'---:|' * 2 * len(rows)}\n"
          f"| {config.tag or config.base_url} | {' | '.join(cells)} |")
    return rows


def run_bench_serving(config: ServingConfig) -> dict:
    """Run the benchmark; print the result block; append the JSON line; return it."""
    config = replace(config, base_url=config.base_url.rstrip("/"))
    with httpx.Client(timeout=30) as client:
        model, root = discover_model(client, config.base_url)
    model = config.model or model
    tokenizer = load_bench_tokenizer(config.tokenizer or root)
    requests = sample_requests(config.dataset, tokenizer)
    print(f"#Input tokens: {sum(r.prompt_len for r in requests)}")
    print(f"#Output tokens: {sum(r.output_len for r in requests)}")
    baseline = config.baseline_file and load_baseline(config.baseline_file, requests)
    counts_before = server_counts(config.base_url)
    results, duration = asyncio.run(run_requests(config, model, requests))
    counts_after = server_counts(config.base_url)
    failures = [r for r in results if not r.success]
    if failures:
        print(f"{len(failures)} of {len(results)} requests failed; the first error:\n"
              f"{failures[0].error}", file=sys.stderr)
    metrics = compute_metrics(results, duration, tokenizer)
    if counts_before is not None and counts_after is not None:
        metrics.update(run_counts(counts_before, counts_after))
    print_result(config, metrics)
    details = request_details(results)
    if baseline:
        metrics.update(compare_to_baseline(details, baseline))
    if config.output_details:
        metrics.update(details)
    if config.plot:
        from braid.bench.plots import plot_serving_run

        plot_serving_run(results, config.plot,
                         f"{config.backend} {model}: {config.dataset.num_prompts} prompts, "
                         f"concurrency {config.max_concurrency or 'unlimited'}, "
                         f"rate {config.request_rate}")
    dataset = config.dataset
    row = {"tag": config.tag, "backend": config.backend, "dataset_name": dataset.dataset_name,
           "request_rate": config.request_rate, "max_concurrency": config.max_concurrency,
           "random_input_len": dataset.random_input_len,
           "random_output_len": dataset.random_output_len,
           "random_range_ratio": dataset.random_range_ratio,
           "num_prompts": dataset.num_prompts, "model": model, **metrics}
    if config.output_file:
        with open(config.output_file, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row
