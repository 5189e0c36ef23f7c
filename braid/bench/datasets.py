"""Benchmark prompts drawn as SGLang's bench_serving draws them, shared by `bench-serving` and
`bench-offline` so both run exactly the same requests.

- `random-ids`: prompt i is the token ids `(offset_i + i + j) % vocab` for j < its length,
  decoded to text (no dataset file needed);
- `random`: ShareGPT first turns, truncated or repeated to the drawn length;
- `sharegpt`: ShareGPT first turns and answers as they are (output length: the answer's).

Lengths are uniform in [max(1, len * range_ratio), len] (`--random-range-ratio`, default 0.0);
the same `--seed` gives the same requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from braid.config import UserError

DATASETS = ["random-ids", "random", "sharegpt"]


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


def sample_requests(name: str, num_prompts: int, tokenizer, *, input_len: int = 1024,
                    output_len: int = 1024, range_ratio: float = 0.0,
                    dataset_path: str | None = None, seed: int = 1) -> list[BenchRequest]:
    """`num_prompts` requests of dataset `name` (see the module docstring)."""
    if name not in DATASETS:
        raise UserError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {name!r}")
    if num_prompts < 1:
        raise UserError("--num-prompts must be at least 1")
    if not 0 <= range_ratio <= 1:
        raise UserError("--random-range-ratio must be in [0, 1]")
    random.seed(seed)
    np.random.seed(seed)
    if name == "sharegpt":
        return _sharegpt(_load_sharegpt(dataset_path), num_prompts, tokenizer)
    input_lens = random_lens(input_len, range_ratio, num_prompts)
    output_lens = random_lens(output_len, range_ratio, num_prompts)
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
