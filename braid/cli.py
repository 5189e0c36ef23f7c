"""The `braid` command line: generate, serve, the benchmarks and the evaluations (`braid --help`
lists them)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

from braid.config import (
    COMM_CHOICES,
    COMM_COMPRESSION_CHOICES,
    COMPILE_CHOICES,
    DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    SPECULATIVE_CHOICES,
    SWITCH_CHOICES,
    EngineConfig,
    default_model_path,
)
from braid.errors import UserError


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that launches ranks."""
    parser.add_argument("--model", default=None,
                        help="GGUF file or Hugging Face folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (processes)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto: bf16 where computed natively (CUDA, AVX512-BF16, AMX), "
                             "else fp32")
    parser.add_argument("--comm", choices=COMM_CHOICES, default="auto",
                        help="collectives: shm (shared memory, CPU ranks on one host), torch "
                             "(torch.distributed: gloo on CPU, NCCL on GPU); auto picks shm "
                             "where it applies")
    parser.add_argument("--comm-timeout", type=float, default=60.0, metavar="S",
                        help="seconds a collective waits for the other ranks before failing "
                             "(across hosts: how soon a lost host ends the launch)")
    parser.add_argument("--comm-compression", choices=COMM_COMPRESSION_CHOICES, default="auto",
                        help="how partial sums cross the network: int8 (per 64-element "
                             "scales, about half of bf16's bytes), bf16 (for fp32 models), "
                             "none; auto learns per step size whether int8 pays where the "
                             "ranks span hosts, else none")
    parser.add_argument("--skip-comm", action="store_true",
                        help="turn collectives into no-ops (wrong outputs; timing only)")
    parser.add_argument("--max-total-tokens", type=int, default=32768,
                        help="KV cache capacity in tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one step: running decodes first, then prompt "
                             "chunks (longer prompts are prefilled over several steps); "
                             "default 2048 on CPU, 8192 on CUDA")
    parser.add_argument("--max-running-requests", type=int,
                        default=EngineConfig.max_running_requests,
                        help="most sequences decoding at once")
    parser.add_argument("--max-skip-age", dest="max_skip_age_s", type=float,
                        default=EngineConfig.max_skip_age_s, metavar="S",
                        help="a waiting prompt too big for the free KV cache is overtaken by "
                             "others that fit for at most S seconds, then admission waits for it")
    parser.add_argument("--no-prefix-cache", dest="prefix_caching", action="store_false",
                        help="do not share the KV blocks of prompts that start alike")
    parser.add_argument("--overlap", choices=SWITCH_CHOICES, default="auto",
                        help="two-batch overlap: on, off, or auto (with several ranks, learned "
                             "per step size while running: each setting probed, the faster "
                             "kept, probed again when times drift)")
    parser.add_argument("--overlap-min-tokens", type=int, default=None,
                        help="make --overlap auto a fixed rule instead: split from this many "
                             "tokens per step (bench-one-batch --overlap-sweep measures it)")
    parser.add_argument("--tbo-token-distribution-threshold", type=float, default=0.48,
                        help="smallest token share of a micro-batch before a sequence is cut "
                             "in two instead")
    parser.add_argument("--dp-linear", choices=SWITCH_CHOICES, default="auto",
                        help="split replicated projections (DeepSeek's fused q_a/kv_a) over "
                             "tokens and all-gather: on, off, or auto (learned per step size, "
                             "as --overlap auto)")
    parser.add_argument("--dp-linear-min-tokens", type=int, default=None,
                        help="make --dp-linear auto a fixed rule instead: split from this many "
                             "tokens per step (bench-dp-linear measures it)")
    parser.add_argument("--quantization", choices=["none", "int8"], default="none",
                        help="int8: per-channel int8 copies of the linear weights, used by GEMMs "
                             "of a few rows (decode at small batch; bf16/fp16 models)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="int8: store keys and values as int8 with a scale per token and "
                             "KV head (half the cache's bytes of bf16, faster decode attention "
                             "over long contexts); auto: the model's dtype")
    parser.add_argument("--no-weight-packing", dest="weight_packing", action="store_false",
                        help="keep bf16 linear weights row-major only on CPU, without "
                             "oneDNN's blocked copy (which makes GEMMs of up to 256 rows, "
                             "decode, about 1.4x faster, and costs the weights' memory again)")
    parser.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="compiled steps at any tp (CPU, Llama): each decode step as one "
                             "saved graph, prompt and mixed steps as compiled pieces between "
                             "attention calls. auto: `serve` compiles (or loads) them at start, "
                             "generate/LLM when the job repays it; on: always at start; off: "
                             "eager. Eager steps of 128+ tokens fuse their elementwise work "
                             "unless off")
    parser.add_argument("--speculative", choices=SPECULATIVE_CHOICES, default="off",
                        help="speculative decoding: ngram proposes the tokens that followed the "
                             "latest earlier occurrence of a sequence's last n tokens in its "
                             "own prompt and output (prompt lookup), draft a small model's "
                             "greedy tokens (--draft-model); each step verifies them and keeps "
                             "the longest accepted run, exactly (outputs are plain decoding's); "
                             "proposals are sized per step from the measured acceptance and "
                             "step times")
    parser.add_argument("--draft-model", default=None, metavar="PATH",
                        help="--speculative draft: a model sharing the tokenizer (GGUF file or "
                             "folder), run in the engine's process")
    parser.add_argument("--speculative-tokens", type=int, default=EngineConfig.speculative_tokens,
                        help="most tokens a sequence proposes per step")
    parser.add_argument("--ngram-min", type=int, default=EngineConfig.ngram_min,
                        help="shortest suffix --speculative ngram looks up")
    parser.add_argument("--ngram-max", type=int, default=EngineConfig.ngram_max,
                        help="longest suffix --speculative ngram looks up (tried first)")
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="neither read nor write braid's cache ($XDG_CACHE_HOME/braid): "
                             "what is derived from a GGUF file (config, tokenizer, dequantised "
                             "weights) and the saved decode graphs. The C++ operators' build "
                             "(native/) and inductor's kernels (inductor/) stay cached there")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda (rank r uses cuda:r; collectives via NCCL)")
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help="write a Chrome/Perfetto trace of stages and collectives per rank "
                             "(FILE.rank<r>.json)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """`LLM` keyword arguments from the engine flags."""
    return dict(model=args.model, tp=args.tp, dtype=args.dtype, comm=args.comm,
                comm_timeout_s=args.comm_timeout, comm_compression=args.comm_compression,
                skip_comm=args.skip_comm, max_total_tokens=args.max_total_tokens,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_running_requests=args.max_running_requests,
                max_skip_age_s=args.max_skip_age_s, prefix_caching=args.prefix_caching,
                overlap=args.overlap, overlap_min_tokens=args.overlap_min_tokens,
                tbo_token_distribution_threshold=args.tbo_token_distribution_threshold,
                dp_linear=args.dp_linear, dp_linear_min_tokens=args.dp_linear_min_tokens,
                device=args.device, trace=args.trace, cache=args.cache,
                quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                weight_packing=args.weight_packing,
                compile=args.compile, speculative=args.speculative,
                speculative_tokens=args.speculative_tokens, ngram_min=args.ngram_min,
                ngram_max=args.ngram_max, draft_model=args.draft_model)


def cmd_generate(args: argparse.Namespace) -> None:
    from braid.engine.request import SamplingParams
    from braid.frontend.llm import LLM

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            structured=structured_outputs(args))
    with LLM(**engine_kwargs(args)) as llm:
        start = time.perf_counter()
        outputs = llm.generate(args.prompts, params, chat=args.chat)
        if args.verbose:
            print_run_figures(llm.core.stats(), outputs, time.perf_counter() - start)
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text,
                              "token_ids": out.token_ids}), flush=True)
        else:
            print(out.text.strip() if len(outputs) == 1 else f"[{out.prompt}] {out.text.strip()}")


def print_run_figures(stats, outputs, seconds: float) -> None:
    """`generate --verbose`: what the run did, to stderr."""
    generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    paths = ", ".join(f"{path} {n}" for path, n in sorted(stats.steps_by_path.items()))
    lines = [f"generated {generated} tokens in {seconds:.2f} s ({generated / seconds:.1f} "
             f"tokens/s, any compiling included); {stats.num_steps} steps: {paths}"]
    if stats.num_draft_tokens:
        lines.append(f"speculative decoding: {stats.num_accepted_tokens} of "
                     f"{stats.num_draft_tokens} proposed tokens accepted "
                     f"({stats.num_accepted_tokens / stats.num_draft_tokens:.0%})")
    for line in lines:
        print(f"braid: {line}", file=sys.stderr)


def structured_outputs(args: argparse.Namespace):
    """`braid generate`'s output constraint: --json-schema FILE or --regex (or None)."""
    from braid.engine.grammar import StructuredOutputs

    if args.json_schema is not None and args.regex is not None:
        raise UserError("give --json-schema or --regex, not both")
    if args.json_schema is not None:
        return StructuredOutputs(json=read_text(args.json_schema, "--json-schema"),
                                 source="--json-schema")
    if args.regex is not None:
        return StructuredOutputs(regex=args.regex, source="--regex")
    return None


def json_object(text: str | None, flag: str) -> dict:
    """A flag's JSON object ({} when absent); `UserError` naming the flag otherwise."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{flag}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise UserError(f"{flag}: expected a JSON object")
    return value


def read_text(path: str, flag: str) -> str:
    """A file a flag names, as text (`UserError` naming the flag if it cannot be read)."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: {e}") from None


def api_key(args: argparse.Namespace) -> str | None:
    """The server's key: --api-key, the first line of --api-key-file, or $BRAID_API_KEY."""
    if args.api_key is not None and args.api_key_file is not None:
        raise UserError("give --api-key or --api-key-file, not both")
    key = args.api_key
    if args.api_key_file is not None:
        lines = read_text(args.api_key_file, "--api-key-file").splitlines()
        key = lines[0].strip() if lines else ""
    if key is None:
        key = os.environ.get("BRAID_API_KEY") or None
    if key is not None and (not key or any(c.isspace() for c in key)):
        raise UserError("the API key must be one word without spaces")
    return key


# `braid serve`'s request limits (`RequestLimits` fields) and what each bounds.
LIMIT_FLAGS = {
    "max_request_bytes": "largest request body; beyond, 413 before it is parsed",
    "max_sequences_per_request": "most completions (prompts x n) one request may ask for",
    "max_queued_sequences": "most sequences waiting for admission; beyond, 429 with Retry-After",
    "max_stop_strings": "most stop strings a request may give",
    "max_stop_string_chars": "longest stop string, in characters",
    "max_token_ids": "most entries of stop_token_ids and of logit_bias",
}


def cmd_serve(args: argparse.Namespace) -> int:
    from braid.server.async_engine import EngineDead
    from braid.server.protocol import RequestLimits
    from braid.server.serve import ServeSettings, run_server

    try:
        limits = RequestLimits(**{name: getattr(args, name) for name in LIMIT_FLAGS})
    except ValueError as e:
        raise UserError(str(e)) from None
    key = api_key(args)
    if args.api_key_all_routes and key is None:
        raise UserError("--api-key-all-routes needs a key (--api-key, --api-key-file or "
                        "$BRAID_API_KEY)")
    settings = ServeSettings(host=args.host, port=args.port,
                             served_model_name=args.served_model_name, api_key=key,
                             api_key_all_routes=args.api_key_all_routes,
                             log_level=args.log_level, shutdown_timeout=args.shutdown_timeout,
                             limits=limits, report_cached_tokens=args.report_cached_tokens,
                             chat_template=(read_text(args.chat_template, "--chat-template")
                                            if args.chat_template else None),
                             tool_call_parser=args.tool_call_parser)
    config = EngineConfig(**{**engine_kwargs(args), "model": args.model or default_model_path()})
    try:
        return run_server(config, settings)
    except EngineDead as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def cmd_bench_serving(args: argparse.Namespace) -> None:
    from braid.bench.serving import ServingConfig, run_bench_serving

    run_bench_serving(ServingConfig(
        base_url=args.base_url, backend=args.backend, model=args.model,
        tokenizer=args.tokenizer, dataset_name=args.dataset_name,
        dataset_path=args.dataset_path, num_prompts=args.num_prompts,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, seed=args.seed,
        tokenize_prompt=args.tokenize_prompt, warmup_requests=args.warmup_requests,
        extra_request_body=json_object(args.extra_request_body, "--extra-request-body"),
        output_file=args.output_file, plot=args.plot, tag=args.tag,
        disable_tqdm=args.disable_tqdm))


def cmd_bench_offline(args: argparse.Namespace) -> None:
    from braid.bench.offline import run_bench_offline

    run_bench_offline(engine_kwargs(args), args.dataset_name, args.num_prompts,
                      args.random_input_len, args.random_output_len, args.random_range_ratio,
                      args.dataset_path, args.seed, args.output_file, args.tag)


def cmd_plot(args: argparse.Namespace) -> None:
    from braid.bench.plots import plot_results

    kinds = plot_results(args.files, args.out)
    print(f"wrote {args.out} ({', '.join(kinds)})")


def cmd_eval_mmlu(args: argparse.Namespace) -> None:
    from braid.eval.mmlu import run_eval_mmlu

    engine = engine_kwargs(args)
    engine["model"] = engine["model"] or default_model_path()
    run_eval_mmlu(args.data_dir, args.subjects, args.num_shots, args.limit, args.backend,
                  engine, args.base_url, args.served_model, args.tokenizer, args.concurrency,
                  args.output_file)


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The request set of bench-serving and bench-offline (SGLang's flags and defaults)."""
    from braid.bench.datasets import DATASETS

    parser.add_argument("--dataset-name", choices=DATASETS, default="random-ids",
                        help="random-ids: random token ids (no file); random: ShareGPT text "
                             "cut to the drawn lengths; sharegpt: ShareGPT turns as they are; "
                             "copy-edit: copy braid's own source with one rename (no file; "
                             "for n-gram speculative decoding)")
    parser.add_argument("--dataset-path", default=None, help="a ShareGPT JSON file")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=1024)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths are uniform in [len * ratio, len]; 1.0: exactly len")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-file", default=None, help="append one JSON line here")
    parser.add_argument("--tag", default=None,
                        help="a label for this run in the JSON line (and in braid plot)")


def cmd_bench_one_batch(args: argparse.Namespace) -> None:
    from braid.bench.one_batch import OneBatch, run_bench_one_batch

    engine = EngineConfig(**{**engine_kwargs(args), "model": args.model or default_model_path()})
    run_bench_one_batch(engine, OneBatch(
        batch_size=args.batch_size, input_len=args.input_len, output_len=args.output_len,
        backend=args.backend, result_file=args.result_file, warmup=args.warmup,
        measure_exposed=args.measure_exposed, overlap_sweep=args.overlap_sweep,
        compare_dp_linear=args.compare_dp_linear, sweep_batch_sizes=args.sweep_batch_sizes,
        repeat=args.repeat))


def cmd_bench_attention(args: argparse.Namespace) -> None:
    from braid.bench.attention import run_bench_attention

    run_bench_attention(args)


def cmd_bench_comm(args: argparse.Namespace) -> None:
    from braid.bench.comm import run_bench_comm

    run_bench_comm(args)


def cmd_bench_dp_linear(args: argparse.Namespace) -> None:
    from braid.bench.dp_linear import run_bench_dp_linear

    run_bench_dp_linear(args)


def cmd_make_random_model(args: argparse.Namespace) -> None:
    from braid.random_model import make_random_model

    out = make_random_model(args.arch, args.preset, args.out_dir, args.seed, args.dtype)
    print(f"wrote {args.arch} ({args.preset}) to {out}")


def build_parser() -> argparse.ArgumentParser:
    """The `braid` argument parser with all its subcommands."""
    parser = argparse.ArgumentParser(prog="braid", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt: prompt, text, token_ids")
    gen.add_argument("--verbose", action="store_true",
                     help="print the run's figures to stderr: tokens, steps by path, decode "
                          "speed, speculative decoding's acceptance")
    gen.add_argument("--json-schema", default=None, metavar="FILE",
                     help="constrain the output to JSON following this JSON schema")
    gen.add_argument("--regex", default=None,
                     help="constrain the output to text matching this regular expression")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1: this host only)")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the API (default: the checkpoint's name)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health "
                            "and /metrics (visible in ps: prefer --api-key-file or "
                            "$BRAID_API_KEY)")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from this file")
    serve.add_argument("--api-key-all-routes", action="store_true",
                       help="require the key on /health and /metrics too")
    serve.add_argument("--no-cached-tokens", dest="report_cached_tokens", action="store_false",
                       help="leave usage.prompt_tokens_details.cached_tokens out of responses "
                            "(it tells a client which of its prompt blocks others sent; so do "
                            "the prefix-cache counters of /metrics: see --api-key-all-routes)")
    from braid.server.protocol import RequestLimits

    limits = RequestLimits()
    for flag, help_text in LIMIT_FLAGS.items():
        serve.add_argument("--" + flag.replace("_", "-"), type=int,
                           default=getattr(limits, flag), metavar="N",
                           help=f"{help_text} (default %(default)s)")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template replacing the model's (e.g. one that "
                            "takes tools)")
    from braid.server.tool_calls import TOOL_CALL_PARSERS

    serve.add_argument("--tool-call-parser", default="auto",
                       choices=["auto", "none", *TOOL_CALL_PARSERS],
                       help="how tool calls are read from the output of tool_choice auto "
                            "(default auto: from the chat template's markers)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                       help="on SIGINT/SIGTERM, seconds in-flight requests get to finish "
                            "before they are aborted")
    serve.set_defaults(func=cmd_serve)

    serving = sub.add_parser("bench-serving",
                             help="SGLang's bench_serving against an OpenAI-compatible server")
    serving.add_argument("--base-url", default="http://127.0.0.1:30000")
    serving.add_argument("--backend", choices=["braid", "sglang-oai", "vllm", "openai"],
                         default="braid", help="openai: no ignore_eos in the requests")
    serving.add_argument("--model", default=None, help="default: the server's first model")
    serving.add_argument("--tokenizer", default=None,
                         help="local GGUF file or model folder (default: the path the server "
                              "reports for its model)")
    add_dataset_args(serving)
    serving.add_argument("--request-rate", type=float, default=float("inf"),
                         help="requests per second, Poisson arrivals (inf: all at once)")
    serving.add_argument("--max-concurrency", type=int, default=None)
    serving.add_argument("--extra-request-body", default=None, metavar="JSON",
                         help="a JSON object merged into every request's body (SGLang's flag), "
                              'e.g. \'{"response_format": {...}}\'')
    serving.add_argument("--tokenize-prompt", action="store_true",
                         help="send token ids instead of text, so prompt lengths are exact")
    serving.add_argument("--warmup-requests", type=int, default=1)
    serving.add_argument("--plot", default=None, metavar="F.png",
                         help="plot this run: TTFT and ITL distributions, output over time")
    serving.add_argument("--disable-tqdm", action="store_true")
    serving.set_defaults(func=cmd_bench_serving)

    offline = sub.add_parser("bench-offline",
                             help="bench-serving's requests through the offline engine")
    add_engine_args(offline)
    add_dataset_args(offline)
    offline.set_defaults(func=cmd_bench_offline)

    plot = sub.add_parser("plot", help="bar charts across the rows of result JSONL files")
    plot.add_argument("files", nargs="+", metavar="FILE.jsonl",
                      help="bench-one-batch, bench-serving, bench-offline or eval-mmlu rows")
    plot.add_argument("--out", required=True, metavar="F.png")
    plot.set_defaults(func=cmd_plot)

    mmlu = sub.add_parser("eval-mmlu", help="MMLU accuracy (original 5-shot prompt)")
    add_engine_args(mmlu)
    mmlu.add_argument("--data-dir", required=True,
                      help="MMLU folder with dev/ and test/ CSV files")
    mmlu.add_argument("--subjects", default="all", help="all, or comma-separated subjects")
    mmlu.add_argument("--num-shots", type=int, default=5)
    mmlu.add_argument("--limit", type=int, default=None,
                      help="first N test questions of each subject")
    mmlu.add_argument("--backend", choices=["braid", "hf", "openai"], default="braid",
                      help="hf: transformers on the same weights; openai: a server's prompt "
                           "logprobs (--base-url)")
    mmlu.add_argument("--base-url", default=None, help="the server, for --backend openai")
    mmlu.add_argument("--served-model", default=None,
                      help="--backend openai: the model name (default: the server's first)")
    mmlu.add_argument("--tokenizer", default=None,
                      help="--backend openai: local tokenizer path (default: the server's)")
    mmlu.add_argument("--concurrency", type=int, default=8,
                      help="--backend openai: questions in flight")
    mmlu.add_argument("--output-file", default=None,
                      help="append the run (every answer) as a JSON line; runs in the file "
                           "are compared")
    mmlu.set_defaults(func=cmd_eval_mmlu)

    bench = sub.add_parser("bench-one-batch",
                           help="latency of one static batch: prefill, then decode steps")
    add_engine_args(bench)
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--input-len", type=int, default=1024)
    bench.add_argument("--output-len", type=int, default=16)
    bench.add_argument("--backend", choices=["braid", "hf", "llama.cpp"], default="braid",
                       help="hf: the same workload through Hugging Face transformers; "
                            "llama.cpp: through llama.cpp on the same GGUF file (needs "
                            "`make bench-deps`)")
    bench.add_argument("--result-file", default=None, help="append one JSONL row here")
    bench.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    bench.add_argument("--measure-exposed", action="store_true",
                       help="time overlap off and on, each with and without collectives: "
                            "exposed communication and overlap efficiency")
    bench.add_argument("--overlap-sweep", action="store_true",
                       help="overlap off/on over --sweep-batch-sizes (prefill of --input-len "
                            "tokens each, and decode); prints the --overlap-min-tokens to set")
    bench.add_argument("--compare-dp-linear", default=None, metavar="MODES",
                       help="time these --dp-linear modes (e.g. off,on) alternately in one "
                            "launch, --repeat rounds; prints each mode's best prefill and "
                            "median decode and the ratios to the first mode")
    bench.add_argument("--sweep-batch-sizes", default="1,4,16,64")
    bench.add_argument("--repeat", type=int, default=2,
                       help="timed runs per sweep point or compared mode (the fastest counts)")
    bench.set_defaults(func=cmd_bench_one_batch)

    attn = sub.add_parser("bench-attention",
                          help="each attention path at the engine's shapes, side by side")
    attn.add_argument("--model", default=None, help="whose head counts and head dim to use "
                                                    "(default: the embedded model)")
    attn.add_argument("--tp", type=int, default=1, help="shape of rank 0's heads at this tp")
    attn.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    attn.add_argument("--repeat", type=int, default=20, help="timed calls per path (median)")
    attn.add_argument("--result-file", default=None, help="append one JSONL row per path")
    attn.set_defaults(func=cmd_bench_attention)

    comm = sub.add_parser("bench-comm", help="collective latency and bandwidth per backend")
    comm.add_argument("--tp", type=int, default=2)
    comm.add_argument("--backend", choices=["shm", "torch", "both"], default="both")
    comm.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    comm.add_argument("--sizes", default="4K,64K,1M,4M,16M",
                      help="comma-separated byte counts with K/M/G suffixes")
    comm.add_argument("--result-file", default=None, help="append one JSONL row per measurement")
    comm.set_defaults(func=cmd_bench_comm)
    dpl = sub.add_parser("bench-dp-linear",
                         help="per-rank time of a model's fused replicated projection: "
                              "replicated vs DataParallelLinear (token split + all-gather)")
    dpl.add_argument("--model", required=True, help="a DeepSeek folder (its config is read)")
    dpl.add_argument("--tp", type=int, default=2)
    dpl.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    dpl.add_argument("--comm", choices=COMM_CHOICES, default="auto")
    dpl.add_argument("--tokens", default="1,32,256,1024,4096",
                     help="comma-separated token counts")
    dpl.add_argument("--repeat", type=int, default=5, help="timed runs per point (median)")
    dpl.add_argument("--result-file", default=None, help="append one JSONL row per point")
    dpl.set_defaults(func=cmd_bench_dp_linear)

    rand = sub.add_parser("make-random-model",
                          help="write a random-weight Hugging Face folder (config, safetensors, "
                               "the embedded model's tokenizer)")
    from braid.random_model import ARCHS, PRESETS

    rand.add_argument("--arch", choices=ARCHS, required=True)
    rand.add_argument("--preset", choices=PRESETS, default="tiny",
                      help="tiny: test-sized, uneven head and expert splits, sliding windows; "
                           "bench: 4 layers at a ~1B model's widths (DeepSeek: V2-Lite's)")
    rand.add_argument("--seed", type=int, default=0)
    rand.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                      help="stored dtype (default: fp32 for tiny, bf16 for bench)")
    rand.add_argument("out_dir", metavar="OUT_DIR")
    rand.set_defaults(func=cmd_make_random_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: exit 0 on success, 2 for a user error, 1 when a rank failed."""
    args = build_parser().parse_args(argv)
    # SIGTERM exits through Python's shutdown, so ranks are stopped and shm segments removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    warnings.formatwarning = lambda msg, cat, *a, **k: f"warning: {msg}\n"
    from braid.distributed.ranks import RankFailure
    from braid.distributed.ranks.torchrun import run_torchrun_worker, torchrun_rank

    try:
        launched = torchrun_rank()
        if launched is not None and launched[0] != 0:
            # Under torchrun only rank 0 runs the command; the others serve its steps.
            from braid.engine.executor import WORKER_MAIN

            run_torchrun_worker(WORKER_MAIN)
            return 0
        return args.func(args) or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
