"""The `braid` command line: generate, serve, the benchmarks and the evaluations (`braid --help`
lists them)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import warnings

from braid.config import COMM_CHOICES, DTYPE_CHOICES, EngineConfig
from braid.errors import UserError
from braid.settings import add_arguments, from_arguments, read_text

# The sampling settings `braid generate` takes as flags (`SamplingParams` fields)
GENERATE_SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")


def cmd_generate(args: argparse.Namespace) -> None:
    from braid.engine.request import SamplingParams
    from braid.frontend.llm import LLM

    params = from_arguments(SamplingParams, args, structured=structured_outputs(args))
    with LLM.from_config(from_arguments(EngineConfig, args)) as llm:
        start = time.perf_counter()
        outputs = llm.generate(args.prompts, params, chat=args.chat)
        if args.verbose:
            print_run_figures(llm.core.stats(), outputs, time.perf_counter() - start,
                              llm.core.executor.ready.kernels)
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": out.text,
                              "token_ids": out.token_ids}), flush=True)
        else:
            print(out.text.strip() if len(outputs) == 1 else f"[{out.prompt}] {out.text.strip()}")


def print_run_figures(stats, outputs, seconds: float, kernels: str) -> None:
    """`generate --verbose`: what the run did, to stderr."""
    generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    paths = ", ".join(f"{path} {n}" for path, n in sorted(stats.steps_by_path.items()))
    lines = [f"generated {generated} tokens in {seconds:.2f} s ({generated / seconds:.1f} "
             f"tokens/s, any compiling included); {stats.num_steps} steps: {paths}",
             f"kernels (rank 0): {kernels}"]
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


def cmd_serve(args: argparse.Namespace) -> int:
    from braid.server.async_engine import EngineDead
    from braid.server.serve import run_server
    from braid.server.settings import ServeSettings

    settings = from_arguments(ServeSettings, args)
    try:
        return run_server(from_arguments(EngineConfig, args), settings)
    except EngineDead as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def cmd_bench_serving(args: argparse.Namespace) -> None:
    from braid.bench.serving import ServingConfig, run_bench_serving, run_concurrency_table

    config = from_arguments(ServingConfig, args)
    if config.preset == "concurrency-table":
        run_concurrency_table(config)
    else:
        run_bench_serving(config)


def cmd_bench_offline(args: argparse.Namespace) -> None:
    from braid.bench.offline import OfflineConfig, run_bench_offline

    run_bench_offline(from_arguments(EngineConfig, args), from_arguments(OfflineConfig, args))


def cmd_plot(args: argparse.Namespace) -> None:
    from braid.bench.plots import plot_results

    kinds = plot_results(args.files, args.out)
    print(f"wrote {args.out} ({', '.join(kinds)})")


def cmd_eval_mmlu(args: argparse.Namespace) -> None:
    from braid.eval.mmlu import MmluConfig, run_eval_mmlu

    run_eval_mmlu(from_arguments(MmluConfig, args), from_arguments(EngineConfig, args))


def cmd_eval_perplexity(args: argparse.Namespace) -> None:
    from braid.eval.perplexity import PerplexityConfig, run_eval_perplexity

    run_eval_perplexity(from_arguments(PerplexityConfig, args), from_arguments(EngineConfig, args))


def cmd_bench_one_batch(args: argparse.Namespace) -> None:
    from braid.bench.harness import OneBatch
    from braid.bench.one_batch import run_bench_one_batch

    run_bench_one_batch(from_arguments(EngineConfig, args), from_arguments(OneBatch, args))


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

    out = make_random_model(args.arch, args.preset, args.out_dir, args.seed, args.dtype,
                            mtp_copy=args.mtp_copy)
    print(f"wrote {args.arch} ({args.preset}) to {out}")


def _generate_flags(gen: argparse.ArgumentParser) -> None:
    from braid.engine.request import SamplingParams

    add_arguments(gen, EngineConfig)
    add_arguments(gen, SamplingParams, only=GENERATE_SAMPLING)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt: prompt, text, token_ids")
    gen.add_argument("--verbose", action="store_true",
                     help="print the run's figures to stderr: tokens, steps by path, decode "
                          "speed, speculative decoding's acceptance, the kernels")
    gen.add_argument("--json-schema", default=None, metavar="FILE",
                     help="constrain the output to JSON following this JSON schema")
    gen.add_argument("--regex", default=None,
                     help="constrain the output to text matching this regular expression")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")


def _serve_flags(serve: argparse.ArgumentParser) -> None:
    from braid.server.settings import ServeSettings

    add_arguments(serve, EngineConfig)
    add_arguments(serve, ServeSettings)


def _bench_serving_flags(serving: argparse.ArgumentParser) -> None:
    from braid.bench.serving import ServingConfig

    add_arguments(serving, ServingConfig)


def _bench_offline_flags(offline: argparse.ArgumentParser) -> None:
    from braid.bench.offline import OfflineConfig

    add_arguments(offline, EngineConfig)
    add_arguments(offline, OfflineConfig)


def _plot_flags(plot: argparse.ArgumentParser) -> None:
    plot.add_argument("files", nargs="+", metavar="FILE.jsonl",
                      help="bench-one-batch, bench-serving, bench-offline or eval-mmlu rows")
    plot.add_argument("--out", required=True, metavar="F.png")


def _eval_mmlu_flags(mmlu: argparse.ArgumentParser) -> None:
    from braid.eval.mmlu import MmluConfig

    add_arguments(mmlu, EngineConfig)
    add_arguments(mmlu, MmluConfig)


def _eval_perplexity_flags(perplexity: argparse.ArgumentParser) -> None:
    from braid.eval.perplexity import PerplexityConfig

    add_arguments(perplexity, EngineConfig)
    add_arguments(perplexity, PerplexityConfig)


def _bench_one_batch_flags(bench: argparse.ArgumentParser) -> None:
    from braid.bench.harness import OneBatch

    add_arguments(bench, EngineConfig)
    add_arguments(bench, OneBatch)


def _bench_attention_flags(attn: argparse.ArgumentParser) -> None:
    attn.add_argument("--model", default=None, help="whose head counts and head dim to use "
                                                    "(default: the embedded model)")
    attn.add_argument("--tp", type=int, default=1, help="shape of rank 0's heads at this tp")
    attn.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    attn.add_argument("--repeat", type=int, default=20, help="timed calls per path (median)")
    attn.add_argument("--result-file", default=None, help="append one JSONL row per path")
    attn.add_argument("--read-rate", action="store_true",
                      help="instead: the decode operator's KV read rate over a model's worth of "
                           "layers against a memory read probe, on one rank's cores at --tp")
    attn.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                      help="--read-rate: the cache's dtype (auto: the queries')")


def _bench_comm_flags(comm: argparse.ArgumentParser) -> None:
    comm.add_argument("--tp", type=int, default=2)
    comm.add_argument("--backend", choices=["shm", "torch", "both"], default="both")
    comm.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    comm.add_argument("--sizes", default="4K,64K,1M,4M,16M",
                      help="comma-separated byte counts with K/M/G suffixes")
    comm.add_argument("--result-file", default=None, help="append one JSONL row per measurement")


def _bench_dp_linear_flags(dpl: argparse.ArgumentParser) -> None:
    dpl.add_argument("--model", required=True, help="a DeepSeek folder (its config is read)")
    dpl.add_argument("--tp", type=int, default=2)
    dpl.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    dpl.add_argument("--comm", choices=COMM_CHOICES, default="auto")
    dpl.add_argument("--tokens", default="1,32,256,1024,4096",
                     help="comma-separated token counts")
    dpl.add_argument("--repeat", type=int, default=5, help="timed runs per point (median)")
    dpl.add_argument("--result-file", default=None, help="append one JSONL row per point")


def _make_random_model_flags(rand: argparse.ArgumentParser) -> None:
    from braid.random_model import ARCHS, PRESETS

    rand.add_argument("--arch", choices=ARCHS, required=True)
    rand.add_argument("--preset", choices=PRESETS, default="tiny",
                      help="tiny: test-sized, uneven head and expert splits, sliding windows; "
                           "bench: 4 layers at a ~1B model's widths (DeepSeek: V2-Lite's); "
                           "1b, 3b, 8b (llama): Llama 3.2 1B and 3B, Llama 3.1 8B's exact shapes; "
                           "8b (qwen3): Qwen3-8B's")
    rand.add_argument("--seed", type=int, default=0)
    rand.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                      help="stored dtype (default: fp32 for tiny, else bf16)")
    rand.add_argument("--mtp-copy", action="store_true",
                      help="deepseek_v3: one decoder layer and a copy of it as the MTP layer, "
                           "which then proposes the model's own next tokens (but for the "
                           "first token's sway): a draft for --speculative mtp's tests and "
                           "figures")
    rand.add_argument("out_dir", metavar="OUT_DIR")


# Every command: its help line, what adds its flags, and what runs it
COMMANDS = {
    "generate": ("generate text for one or more prompts", _generate_flags, cmd_generate),
    "serve": ("an OpenAI-compatible HTTP server", _serve_flags, cmd_serve),
    "bench-serving": ("SGLang's bench_serving against an OpenAI-compatible server",
                      _bench_serving_flags, cmd_bench_serving),
    "bench-offline": ("bench-serving's requests through the offline engine",
                      _bench_offline_flags, cmd_bench_offline),
    "plot": ("bar charts across the rows of result JSONL files", _plot_flags, cmd_plot),
    "eval-mmlu": ("MMLU accuracy (original 5-shot prompt)", _eval_mmlu_flags, cmd_eval_mmlu),
    "eval-perplexity": ("a text's perplexity, scored as llama.cpp's llama-perplexity scores it",
                        _eval_perplexity_flags, cmd_eval_perplexity),
    "bench-one-batch": ("latency of one static batch: prefill, then decode steps",
                        _bench_one_batch_flags, cmd_bench_one_batch),
    "bench-attention": ("each attention path at the engine's shapes, side by side",
                        _bench_attention_flags, cmd_bench_attention),
    "bench-comm": ("collective latency and bandwidth per backend", _bench_comm_flags,
                   cmd_bench_comm),
    "bench-dp-linear": ("per-rank time of a model's fused replicated projection: replicated "
                        "vs DataParallelLinear (token split + all-gather)",
                        _bench_dp_linear_flags, cmd_bench_dp_linear),
    "make-random-model": ("write a random-weight Hugging Face folder (config, safetensors, the "
                          "embedded model's tokenizer)", _make_random_model_flags,
                          cmd_make_random_model),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `braid` argument parser with all its subcommands. The flags of a command's settings
    come from their declarations (`braid.settings`); only a command's own switches are
    written here. With `command`, only that command gets its flags (the others their name and
    help line), so that a process loads only what its own command needs: `braid serve`'s API
    process no model code."""
    parser = argparse.ArgumentParser(prog="braid", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_flags, run) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text)
        if command is None or command == name:
            add_flags(command_parser)
        command_parser.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: exit 0 on success, 2 for a user error, 1 when a rank failed."""
    argv = sys.argv[1:] if argv is None else argv
    command = next((word for word in argv if not word.startswith("-")), "")
    args = build_parser(command if command in COMMANDS else "").parse_args(argv)
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
