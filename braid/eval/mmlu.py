"""`braid eval-mmlu`: MMLU accuracy as the original evaluation measures it.

Each test question gets the original 5-shot prompt (Hendrycks et al.'s `evaluate.py`, its
double space after "about" included): "The following are multiple choice questions (with
answers) about  {subject}.", then the subject's first `num_shots` dev questions with their
answers, then the question and "Answer:". The prediction is the letter whose token (" A", " B",
" C", " D") has the highest next-token logprob.

Backends score the same token ids:
- `braid`: every prompt in one `LLM.generate` batch, one token each, with the four letters'
  logprobs (`logprob_token_ids`); the prefix cache computes each subject's shots once;
- `hf`: `transformers` on the same weights, the prompts' shared prefix computed once per subject
  and its KV cache reused for every question;
- `openai`: a server's prompt logprobs (`echo`, `logprobs`, `max_tokens` 1) of the prompt with
  each letter appended, as log-likelihood evaluators do.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from braid import settings
from braid.config import EngineConfig
from braid.errors import UserError
from braid.eval.report import append_row, describe_run
from braid.settings import setting

LETTERS = "ABCD"


@dataclass(frozen=True)
class Question:
    """One test question: its subject, row in the test split, prompt and answer letter."""

    subject: str
    index: int
    prompt: str
    answer: str


def list_subjects(data_dir: Path) -> list[str]:
    """Subjects with both a dev and a test file."""
    dev = {p.name.removesuffix("_dev.csv") for p in (data_dir / "dev").glob("*_dev.csv")}
    test = {p.name.removesuffix("_test.csv") for p in (data_dir / "test").glob("*_test.csv")}
    return sorted(dev & test)


def data_subjects(root: Path) -> list[str]:
    """`list_subjects`, or `UserError` where the folder holds no MMLU data."""
    available = list_subjects(root) if root.is_dir() else []
    if not available:
        raise UserError(f"{root} has no MMLU data (expected dev/*_dev.csv and "
                        "test/*_test.csv)")
    return available


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return [row for row in csv.reader(f) if row]


def format_example(row: list[str], with_answer: bool) -> str:
    """The original format: question, lettered choices, "Answer:" (and the answer)."""
    text = row[0] + "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, row[1:5]))
    return text + "\nAnswer:" + (f" {row[5]}\n\n" if with_answer else "")


def subject_header(subject: str) -> str:
    # The original joins the words with a leading space each: "about  abstract algebra."
    return ("The following are multiple choice questions (with answers) about "
            f"{''.join(' ' + word for word in subject.split('_'))}.\n\n")


def dev_text(data_dir: str) -> str:
    """Every subject's header and solved dev questions, in subject order: a fixed text of
    about 30,000 tokens to score perplexity on."""
    root = Path(data_dir)
    return "".join(subject_header(subject) + "".join(
        format_example(row, True) for row in _rows(root / "dev" / f"{subject}_dev.csv"))
        for subject in data_subjects(root))


def load_questions(data_dir: str, subjects: str, num_shots: int,
                   limit: int | None) -> list[Question]:
    """The test questions of `subjects` ("all" or "a,b"), the first `limit` of each, with
    `num_shots`-shot prompts."""
    root = Path(data_dir)
    available = data_subjects(root)
    chosen = available if subjects == "all" else [s.strip() for s in subjects.split(",")]
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        raise UserError(f"unknown MMLU subject(s): {', '.join(unknown)}; the data has "
                        f"{len(available)} subjects, e.g. {', '.join(available[:3])}")
    if num_shots < 0 or (limit is not None and limit < 1):
        raise UserError("--num-shots must be >= 0 and --limit >= 1")
    questions = []
    for subject in chosen:
        shots = _rows(root / "dev" / f"{subject}_dev.csv")[:num_shots]
        prefix = subject_header(subject) + "".join(format_example(s, True) for s in shots)
        for index, row in enumerate(_rows(root / "test" / f"{subject}_test.csv")[:limit]):
            questions.append(Question(subject, index, prefix + format_example(row, False),
                                      row[5].strip()))
    return questions


def letter_token_ids(tokenizer) -> list[int]:
    """Token ids of " A" .. " D" (the token that follows "Answer:")."""
    ids = [tokenizer(f" {letter}", add_special_tokens=False)["input_ids"] for letter in LETTERS]
    if any(len(i) != 1 for i in ids):
        raise UserError("this tokenizer does not encode ' A'..' D' as single tokens")
    return [i[0] for i in ids]


@dataclass
class EvalResult:
    """Per question the four letters' logprobs (None: the question could not be scored)."""

    questions: list[Question]
    scores: list[list[float] | None]
    duration_s: float
    extra: dict

    def predictions(self) -> list[str | None]:
        return [None if s is None else LETTERS[int(np.argmax(s))] for s in self.scores]

    def report(self) -> dict:
        """Accuracy per subject, macro (mean over subjects) and micro (over questions)."""
        per_subject: dict[str, list[bool]] = {}
        for q, predicted in zip(self.questions, self.predictions()):
            per_subject.setdefault(q.subject, []).append(predicted == q.answer)
        accuracy = {s: float(np.mean(hits)) for s, hits in per_subject.items()}
        hits = [h for subject in per_subject.values() for h in subject]
        return {"num_questions": len(hits), "micro_accuracy": float(np.mean(hits)),
                "macro_accuracy": float(np.mean(list(accuracy.values()))),
                "subjects": accuracy, "duration_s": self.duration_s,
                "questions_per_s": len(hits) / self.duration_s, **self.extra}


def score_braid(questions: list[Question], engine: EngineConfig) -> EvalResult:
    from braid.engine.request import SamplingParams
    from braid.frontend.llm import LLM

    with LLM.from_config(engine) as llm:
        context = llm.model_config.max_position_embeddings
        letters = letter_token_ids(llm.tokenizer)
        params = SamplingParams(max_new_tokens=1, temperature=0, logprob_token_ids=letters)
        prompts = [llm.encode(q.prompt) for q in questions]
        too_long = sum(len(p) >= context for p in prompts)
        if too_long:
            raise UserError(f"{too_long} prompts do not fit the context; lower --num-shots")
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        duration = time.perf_counter() - start
        scheduler = llm.core.scheduler
        hit_rate = scheduler.prefix_hits / max(1, scheduler.prefix_queries)
    scores = [[lp for _, lp in out.outputs[0].logprobs[0].scored] for out in outputs]
    return EvalResult(questions, scores, duration, {"prefix_cache_hit_rate": hit_rate})


def score_hf(questions: list[Question], model: str, dtype: str) -> EvalResult:
    """transformers, one question at a time after its subject's shared prefix."""
    import copy

    import torch

    from braid.config import DTYPES
    from braid.loader.tokenizer import load_tokenizer
    from braid.loader.transformers_model import load_transformers_model

    hf = load_transformers_model(model, DTYPES[dtype])
    tokenizer = load_tokenizer(model)
    letters = letter_token_ids(tokenizer)
    prompts = [list(tokenizer(q.prompt)["input_ids"]) for q in questions]
    scores: list[list[float] | None] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for subject in dict.fromkeys(q.subject for q in questions):
            ids = [p for p, q in zip(prompts, questions) if q.subject == subject]
            shared = _common_prefix_len(ids) - 1  # leave every question a token to run
            prefix = hf(torch.tensor([ids[0][:shared]]), use_cache=True) if shared > 0 else None
            for prompt in ids:
                cache = copy.deepcopy(prefix.past_key_values) if prefix is not None else None
                out = hf(torch.tensor([prompt[max(shared, 0):]]), past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
                logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                scores.append(logprobs[letters].tolist())
    return EvalResult(questions, scores, time.perf_counter() - start, {})


def _common_prefix_len(prompts: list[list[int]]) -> int:
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for other in prompts[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n


def score_openai(questions: list[Question], base_url: str, model: str | None,
                 tokenizer_path: str | None, concurrency: int) -> EvalResult:
    """A server's prompt logprobs of each prompt with each letter appended."""
    import asyncio

    import httpx

    from braid.bench.client import auth_headers, discover_model, load_bench_tokenizer

    base_url = base_url.rstrip("/")
    with httpx.Client(timeout=30) as client:
        served, root = discover_model(client, base_url)
    tokenizer = load_bench_tokenizer(tokenizer_path or root)
    letters = letter_token_ids(tokenizer)
    prompts = [list(tokenizer(q.prompt)["input_ids"]) for q in questions]
    failures: list[str] = []

    async def score(client: httpx.AsyncClient, limit: asyncio.Semaphore,
                    prompt: list[int]) -> list[float] | None:
        body = {"model": model or served, "prompt": [prompt + [t] for t in letters],
                "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
        async with limit:
            response = await client.post(f"{base_url}/v1/completions", json=body,
                                         headers=auth_headers())
        if response.status_code != 200:
            failures.append(response.text[:300])
            return None
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        return [c["logprobs"]["token_logprobs"][len(prompt)] for c in choices]

    async def score_all() -> list[list[float] | None]:
        limit = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=3600) as client:
            return await asyncio.gather(*(score(client, limit, p) for p in prompts))

    start = time.perf_counter()
    scores = asyncio.run(score_all())
    duration = time.perf_counter() - start
    if failures:
        print(f"{len(failures)} questions could not be scored; the first error: {failures[0]}")
    return EvalResult(questions, scores, duration, {"failed": len(failures)})


def print_report(report: dict, title: str) -> None:
    print(f"\n{title}")
    print(f"{'subject':<40} {'accuracy':>8}")
    for subject, accuracy in report["subjects"].items():
        print(f"{subject:<40} {accuracy:8.3f}")
    print(f"{'micro average':<40} {report['micro_accuracy']:8.3f}   "
          f"({report['num_questions']} questions)")
    print(f"{'macro average':<40} {report['macro_accuracy']:8.3f}")
    print(f"{report['duration_s']:.1f} s, {report['questions_per_s']:.2f} questions/s")


def agreement(rows: list[dict]) -> list[tuple[int, int, float, int]]:
    """Pairwise share of identical answers between runs over the same questions:
    (run i, run j, share, questions)."""
    pairs = []
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            a = {(s, k): p for s, k, p, *_ in rows[i]["answers"]}
            b = {(s, k): p for s, k, p, *_ in rows[j]["answers"]}
            common = a.keys() & b.keys()
            if common:
                same = sum(a[key] == b[key] for key in common) / len(common)
                pairs.append((i, j, same, len(common)))
    return pairs


@dataclass(frozen=True)
class MmluConfig:
    """What `braid eval-mmlu` runs beside the engine's settings (its own flags)."""

    data_dir: str = setting(help="MMLU folder with dev/ and test/ CSV files")
    subjects: str = setting("all", "all, or comma-separated subjects")
    num_shots: int = setting(5, "solved examples before each question", at_least=0)
    limit: int | None = setting(None, "first N test questions of each subject", at_least=1)
    backend: str = setting(
        "braid", "hf: transformers on the same weights; openai: a server's prompt logprobs "
        "(--base-url)", choices=("braid", "hf", "openai"))
    base_url: str | None = setting(None, "the server, for --backend openai")
    served_model: str | None = setting(
        None, "--backend openai: the model name (default: the server's first)")
    tokenizer: str | None = setting(
        None, "--backend openai: local tokenizer path (default: the server's)")
    concurrency: int = setting(8, "--backend openai: questions in flight", at_least=1)
    output_file: str | None = setting(
        None, "append the run (every answer) as a JSON line; runs in the file are compared")

    def __post_init__(self) -> None:
        settings.check(self)
        if self.backend == "openai" and not self.base_url:
            raise UserError("--backend openai needs --base-url")


def run_eval_mmlu(config: MmluConfig, engine: EngineConfig) -> dict:
    """Evaluate, print the report, append the run (every answer included) to the config's
    output file, and print how often the runs in that file agree."""
    questions = load_questions(config.data_dir, config.subjects, config.num_shots, config.limit)
    backend, output_file = config.backend, config.output_file
    print(f"{len(questions)} questions from {len({q.subject for q in questions})} subjects, "
          f"{config.num_shots}-shot, backend {backend}", flush=True)
    if backend == "braid":
        result = score_braid(questions, engine)
    elif backend == "hf":
        result = score_hf(questions, engine.model, engine.dtype)
    else:
        result = score_openai(questions, config.base_url, config.served_model, config.tokenizer,
                              config.concurrency)
    report = result.report()
    described = describe_run(backend, engine)
    if backend == "openai":
        described.update(base_url=config.base_url)
    title = " ".join(f"{k}={v}" for k, v in described.items() if k != "model")
    print_report(report, title)
    row = {"eval": "mmlu", **described, "num_shots": config.num_shots, "limit": config.limit,
           **report,
           # Per question: subject, test row, predicted, correct, the letters' logprobs.
           "answers": [[q.subject, q.index, p, q.answer,
                        None if s is None else [round(x, 5) for x in s]]
                       for q, p, s in zip(questions, result.predictions(), result.scores)]}
    if output_file:
        append_row(output_file, row)
        rows = [json.loads(line) for line in Path(output_file).read_text().splitlines()
                if line.strip()]
        rows = [r for r in rows if r.get("eval") == "mmlu"]
        if len(rows) > 1:
            print(f"\nIdentical answers between the runs in {output_file}:")
            for i, j, same, n in agreement(rows):
                print(f"  run {i} ({rows[i]['backend']}) vs run {j} ({rows[j]['backend']}): "
                      f"{same:.1%} of {n}")
    return row
