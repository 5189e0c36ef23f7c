"""Benchmark prompts drawn as SGLang's bench_serving draws them, shared by `bench-serving` and
`bench-offline` so both run exactly the same requests.

- `random-ids`: prompt i is the token ids `(offset_i + i + j) % vocab` for j < its length,
  decoded to text (no dataset file needed);
- `random`: ShareGPT first turns, truncated or repeated to the drawn length;
- `sharegpt`: ShareGPT first turns and answers as they are (output length: the answer's);
- `copy-edit`: "rewrite exactly, with one change" instructions whose answer repeats the prompt's
  snippet (the case speculative decoding by n-gram lookup pays in): 15-40 consecutive lines of
  one of braid's own modules with an identifier to rename, or one of its docstrings with a word
  to replace (no file needed), as a user turn in the tokenizer's chat template (plain text if it
  has none). Lines are dropped from the snippet's end until the prompt fits its drawn length
  (raised to the shortest that leaves room for a snippet); the output length is the edited
  snippet's token count, capped by the drawn output length. The snippets are braid's source,
  so a given `--seed` gives the same requests for one braid version;
- `copy-edit-mmlu`: the same instructions (a word to replace) over 3-12 consecutive questions,
  with their choices, of one MMLU subject (`--dataset-path`: the MMLU folder, its `test/` CSVs):
  text that braid's code never held, so the figure does not move when the code does.

Lengths are uniform in [max(1, len * range_ratio), len] (`--random-range-ratio`, default 0.0);
the same `--seed` gives the same requests.
"""

from __future__ import annotations

import ast
import builtins
import csv
import functools
import json
import keyword
import random
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from braid.errors import UserError
from braid.settings import check, setting

DATASETS = ("random-ids", "random", "sharegpt", "copy-edit", "copy-edit-mmlu")


@dataclass(frozen=True)
class Dataset:
    """Which requests a benchmark sends (SGLang's flags and defaults)."""

    dataset_name: str = setting(
        "random-ids", "random-ids: random token ids (no file); random: ShareGPT text cut to the "
        "drawn lengths; sharegpt: ShareGPT turns as they are; copy-edit: copy braid's own "
        "source with one rename (no file; for n-gram speculative decoding); copy-edit-mmlu: "
        "copy MMLU questions with one word replaced", choices=DATASETS)
    dataset_path: str | None = setting(
        None, "a ShareGPT JSON file (random, sharegpt) or the MMLU folder (copy-edit-mmlu)")
    num_prompts: int = setting(100, "requests to send", at_least=1)
    random_input_len: int = setting(1024, "prompt length in tokens", at_least=1)
    random_output_len: int = setting(1024, "tokens to generate per request", at_least=1)
    random_range_ratio: float = setting(
        0.0, "lengths are uniform in [len * ratio, len]; 1.0: exactly len", at_least=0)
    seed: int = setting(1, "the draw's seed: the same seed, the same requests")

    def __post_init__(self) -> None:
        check(self)
        if self.random_range_ratio > 1:
            raise UserError("--random-range-ratio must be in [0, 1]")


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: its prompt (text and token ids) and how many tokens to ask for."""

    prompt: str
    prompt_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def random_lens(full_len: int, range_ratio: float, num: int) -> np.ndarray:
    """SGLang's draw: uniform in [max(1, full_len * range_ratio), full_len]."""
    return np.random.randint(max(int(full_len * range_ratio), 1), full_len + 1, size=num)


def sample_requests(dataset: Dataset, tokenizer) -> list[BenchRequest]:
    """The requests `dataset` names (see the module docstring)."""
    name, num_prompts, seed = dataset.dataset_name, dataset.num_prompts, dataset.seed
    input_len, output_len = dataset.random_input_len, dataset.random_output_len
    range_ratio, dataset_path = dataset.random_range_ratio, dataset.dataset_path
    random.seed(seed)
    np.random.seed(seed)
    if name == "sharegpt":
        return _sharegpt(_load_sharegpt(dataset_path), num_prompts, tokenizer)
    input_lens = random_lens(input_len, range_ratio, num_prompts)
    output_lens = random_lens(output_len, range_ratio, num_prompts)
    if name == "copy-edit":
        return _copy_edit(tokenizer, input_len, input_lens, output_lens, _draw_braid_snippet)
    if name == "copy-edit-mmlu":
        questions = _mmlu_questions(dataset_path)
        return _copy_edit(tokenizer, input_len, input_lens, output_lens,
                          lambda: ("prose", _draw_mmlu_snippet(questions)))
    if name == "random-ids":
        vocab = len(tokenizer)
        offsets = np.random.randint(0, vocab, size=num_prompts)
        prompts = [[int(offsets[i] + i + j) % vocab for j in range(input_lens[i])]
                   for i in range(num_prompts)]
    else:
        texts = [turns[0] for turns in _load_sharegpt(dataset_path)]
        random.shuffle(texts)
        prompts = []
        for text in texts:
            ids = tokenizer.encode(text)
            if ids:
                target = int(input_lens[len(prompts)])
                prompts.append((ids * (-(-target // len(ids))))[:target])
            if len(prompts) == num_prompts:
                break
        if len(prompts) < num_prompts:
            raise UserError(f"{dataset_path} has only {len(prompts)} usable conversations")
    return [BenchRequest(tokenizer.decode(ids), ids, int(out))
            for ids, out in zip(prompts, output_lens)]


def _load_sharegpt(path: str | None) -> list[tuple[str, str]]:
    """(first turn, second turn) of every ShareGPT conversation with at least two turns."""
    if not path or not Path(path).is_file():
        raise UserError("this dataset needs --dataset-path, a ShareGPT JSON file (nothing is "
                        "downloaded); --dataset-name random-ids needs no file")
    try:
        data = json.loads(Path(path).read_text())
        return [(c["conversations"][0]["value"], c["conversations"][1]["value"])
                for c in data if len(c.get("conversations", [])) >= 2]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not a ShareGPT JSON file ({e})") from None


def _sharegpt(conversations: list[tuple[str, str]], num_prompts: int,
              tokenizer) -> list[BenchRequest]:
    random.shuffle(conversations)
    requests = []
    for prompt, answer in conversations:
        ids = tokenizer.encode(prompt)
        output_len = len(tokenizer.encode(answer))
        if len(ids) >= 2 and output_len >= 2:  # SGLang's pruning of degenerate turns
            requests.append(BenchRequest(prompt, ids, output_len))
        if len(requests) == num_prompts:
            return requests
    raise UserError(f"the dataset has only {len(requests)} usable conversations")


# copy-edit: a snippet of braid's own source and the instruction to copy it with one edit.
COPY_EDIT_LINES = (15, 40)  # consecutive source lines a code snippet is drawn with
COPY_EDIT_MIN_SNIPPET = 64  # tokens of snippet every prompt leaves room for
COPY_EDIT_MIN_WORDS = 40  # a docstring shorter than this is not a paragraph of prose
_INSTRUCTIONS = {
    "code": "Rewrite the following code exactly, with one change: rename `{old}` to `{new}`. "
            "Output only the code.\n\n{snippet}",
    "prose": "Rewrite the following text exactly, with one change: replace the word `{old}` "
             "with `{new}`. Output only the text.\n\n{snippet}",
}
_NOT_RENAMED = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)) | {"self", "cls"}


def _copy_edit_names(kind: str, snippet: str) -> list[tuple[str, str]]:
    """(old, new) edits a copy-edit prompt may ask for in `snippet`, sorted: identifiers of at
    least three characters (no keywords or builtins) renamed with a `new_`/`New` prefix, or
    lowercase words of at least four letters replaced by their uppercase; never a new name that
    the snippet already holds."""
    if kind == "code":
        olds = {w for w in re.findall(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b", snippet)
                if w not in _NOT_RENAMED}
    else:
        olds = set(re.findall(r"\b[a-z]{4,}\b", snippet))
    edits = []
    for old in sorted(olds):
        if kind == "prose":
            new = old.upper()
        else:
            stem = old.lstrip("_")
            new = old[:len(old) - len(stem)] + ("New" if stem[0].isupper() else "new_") + stem
        if not re.search(rf"\b{re.escape(new)}\b", snippet):
            edits.append((old, new))
    return edits


@functools.lru_cache(maxsize=1)
def _braid_sources() -> tuple[list[list[str]], list[list[str]]]:
    """The lines of braid's modules (those long enough for a snippet) and of its docstrings of
    at least COPY_EDIT_MIN_WORDS words, in path order."""
    import braid

    code, prose = [], []
    for path in sorted(Path(braid.__file__).parent.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        if len(lines) >= COPY_EDIT_LINES[0]:
            code.append(lines)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= COPY_EDIT_MIN_WORDS:
                    prose.append(doc.splitlines())
    return code, prose


def _chat_ids(tokenizer, text: str) -> list[int]:
    """`text` as one user turn in the tokenizer's chat template (the request goes to the
    completions endpoint, which applies none), or as plain text where it has none."""
    if getattr(tokenizer, "chat_template", None):
        from braid.loader.tokenizer import apply_chat_template

        return apply_chat_template(tokenizer, text)
    return list(tokenizer.encode(text))


def _draw_braid_snippet() -> tuple[str, list[str]]:
    """The kind and lines of one snippet of braid's source: a window of consecutive lines of a
    module (dedented, without blank lines at its ends) or a whole docstring."""
    kind = random.choice(("code", "prose"))
    code, prose = _braid_sources()
    if kind == "prose":
        return kind, random.choice(prose)
    lines = random.choice(code)
    size = random.randint(*COPY_EDIT_LINES)
    start = random.randint(0, max(0, len(lines) - size))
    return kind, textwrap.dedent("\n".join(lines[start:start + size])).strip("\n").splitlines()


COPY_EDIT_QUESTIONS = (3, 12)  # consecutive MMLU questions a copy-edit-mmlu snippet holds


@functools.lru_cache(maxsize=1)
def _mmlu_questions(path: str | None) -> tuple[tuple[list[str], ...], ...]:
    """Each subject's test questions as lines (the question, then its lettered choices), from
    the MMLU folder at `path` (its `test/` CSVs: question, A, B, C, D, answer)."""
    if path is None:
        raise UserError("--dataset-name copy-edit-mmlu needs --dataset-path: the MMLU folder "
                        "(its test/ CSVs)")
    files = sorted((Path(path) / "test").glob("*.csv"))
    if not files:
        raise UserError(f"--dataset-path {path}: no MMLU test CSVs in {Path(path) / 'test'}")
    subjects = []
    for file in files:
        with file.open(newline="", encoding="utf-8") as rows:
            subjects.append(tuple([row[0], *(f"{letter}) {choice}" for letter, choice
                                             in zip("ABCD", row[1:5]))]
                                  for row in csv.reader(rows) if len(row) >= 5))
    return tuple(subjects)


def _draw_mmlu_snippet(subjects: tuple[tuple[list[str], ...], ...]) -> list[str]:
    """The lines of a run of consecutive questions of one subject."""
    questions = random.choice(subjects)
    size = random.randint(*COPY_EDIT_QUESTIONS)
    start = random.randint(0, max(0, len(questions) - size))
    return [line for question in questions[start:start + size] for line in question]


def _fit_copy_edit(kind: str, lines: list[str], budget: int,
                   tokenizer) -> tuple[list[int], str] | None:
    """(the prompt's ids, the expected answer) for the longest head of `lines` whose
    prompt takes at most `budget` tokens; None if no head does."""
    count, edit = len(lines), None
    while count > 0:
        snippet = "\n".join(lines[:count])
        edits = _copy_edit_names(kind, snippet)
        if not edits:
            count -= 1
            continue
        if edit not in edits:
            edit = random.choice(edits)
        old, new = edit
        text = _INSTRUCTIONS[kind].format(old=old, new=new, snippet=snippet)
        ids = _chat_ids(tokenizer, text)
        if len(ids) <= budget:
            return ids, re.sub(rf"\b{re.escape(old)}\b", new, snippet)
        # Lines in proportion to the budget (never fewer than fit: the template's tokens are
        # counted with the snippet's), then one at a time.
        count = min(count - 1, count * budget // len(ids))
    return None


def _copy_edit(tokenizer, input_len: int, input_lens: np.ndarray, output_lens: np.ndarray,
               draw: Callable[[], tuple[str, list[str]]]) -> list[BenchRequest]:
    """Copy-edit requests of the drawn lengths, over snippets from `draw` (kind, lines)."""
    overhead = max(len(_chat_ids(tokenizer, t.format(old="", new="", snippet="")))
                   for t in _INSTRUCTIONS.values())
    shortest = overhead + COPY_EDIT_MIN_SNIPPET
    if input_len < shortest:
        raise UserError(f"--dataset-name copy-edit needs --random-input-len of at least "
                        f"{shortest} (the instruction in the chat template takes {overhead} "
                        f"tokens, the snippet at least {COPY_EDIT_MIN_SNIPPET})")
    requests = []
    for drawn_in, drawn_out in zip(input_lens, output_lens):
        budget = max(int(drawn_in), shortest)
        # A snippet with a line too long for the budget is drawn again.
        for _ in range(100):
            kind, lines = draw()
            fitted = _fit_copy_edit(kind, lines, budget, tokenizer)
            if fitted:
                break
        else:
            raise UserError(f"no copy-edit snippet fits in {budget} tokens: raise "
                            f"--random-input-len")
        ids, answer = fitted
        expected = len(tokenizer.encode(answer, add_special_tokens=False))
        requests.append(BenchRequest(tokenizer.decode(ids), ids,
                                     max(1, min(int(drawn_out), expected))))
    return requests
