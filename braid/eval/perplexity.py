"""`braid eval-perplexity`: a text's perplexity, computed the way llama.cpp's `llama-perplexity`
computes it, so the two engines' figures on one file compare directly.

The text is tokenized once (with the tokenizer's BOS where it adds one) and cut into chunks of
`--ctx-size` tokens. Each chunk runs as one prompt, its first token replaced by BOS where the
tokenizer adds one, and only its second half is scored (every token from the logits of the one
before it), so that each scored token has at least half a context behind it. Perplexity is
exp(mean negative log-likelihood), given with llama.cpp's standard error.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from braid import settings
from braid.config import EngineConfig
from braid.errors import UserError
from braid.eval.report import append_row, describe_run
from braid.settings import setting


@dataclass(frozen=True)
class PerplexityConfig:
    """What `braid eval-perplexity` runs beside the engine's settings (its own flags)."""

    text_file: str = setting(help="the text to score (UTF-8)")
    ctx_size: int = setting(512, "tokens per chunk (llama-perplexity's -c); the second half "
                                 "of each chunk is scored", at_least=4)
    chunks: int | None = setting(None, "score only the first N chunks (llama-perplexity's "
                                       "--chunks)", at_least=1)
    backend: str = setting("braid", "hf: transformers on the same weights (a GGUF file "
                                    "dequantized)", choices=("braid", "hf"))
    output_file: str | None = setting(None, "append the run as a JSON line")

    def __post_init__(self) -> None:
        settings.check(self)


@dataclass(frozen=True)
class Chunks:
    """The prompts to run (BOS in front where the tokenizer adds one) and where scoring
    starts in each: the token at `first + 1` is the first one scored."""

    prompts: list[list[int]]
    first: int

    @property
    def scored_per_chunk(self) -> int:
        return len(self.prompts[0]) - self.first - 1


def make_chunks(tokenizer, text: str, ctx_size: int, max_chunks: int | None) -> Chunks:
    """llama-perplexity's chunks of `text`: `UserError` if it holds fewer than two."""
    tokens = list(tokenizer(text)["input_ids"])
    if len(tokens) < 2 * ctx_size:
        raise UserError(f"the text has {len(tokens)} tokens; a context of {ctx_size} needs at "
                        f"least {2 * ctx_size} (a longer text or a smaller --ctx-size)")
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and list(tokenizer("a")["input_ids"][:1]) == [bos]
    count = len(tokens) // ctx_size
    if max_chunks is not None:
        count = min(count, max_chunks)
    prompts = []
    for i in range(count):
        chunk = tokens[i * ctx_size:(i + 1) * ctx_size]
        if adds_bos:
            chunk[0] = bos
        prompts.append(chunk)
    return Chunks(prompts, ctx_size // 2)


@dataclass
class Perplexity:
    """Negative log-likelihoods of the scored tokens, summed as llama.cpp sums them."""

    nll: float = 0.0
    nll_squared: float = 0.0
    count: int = 0

    def add(self, logprobs: list[float]) -> None:
        for logprob in logprobs:
            self.nll -= logprob
            self.nll_squared += logprob * logprob
        self.count += len(logprobs)

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def error(self) -> float:
        """llama-perplexity's `+/-`: the standard error of the mean NLL, times the PPL."""
        mean = self.nll / self.count
        variance = self.nll_squared / self.count - mean * mean
        return math.sqrt(max(variance, 0.0) / (self.count - 1)) * self.value


def score_braid(chunks: Chunks, engine: EngineConfig) -> tuple[list[list[float]], float]:
    """Each chunk's scored logprobs (prompt logprobs of one request per chunk) and the
    seconds the engine took."""
    from braid.engine.request import SamplingParams
    from braid.frontend.llm import LLM

    with LLM.from_config(engine) as llm:
        params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=0)
        start = time.perf_counter()
        outputs = llm.generate(chunks.prompts, params)
        duration = time.perf_counter() - start
    scored = [[entry.logprob for entry in out.prompt_logprobs[chunks.first + 1:]]
              for out in outputs]
    return scored, duration


def score_transformers(chunks: Chunks, model) -> tuple[list[list[float]], float]:
    """The same with a transformers causal LM, one chunk at a time."""
    import torch

    scored = []
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in chunks.prompts:
            ids = torch.tensor([prompt])
            logits = model(ids).logits[0, chunks.first:-1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = ids[0, chunks.first + 1:]
            scored.append(logprobs.gather(1, targets[:, None])[:, 0].tolist())
    return scored, time.perf_counter() - start


def run_eval_perplexity(config: PerplexityConfig, engine: EngineConfig) -> dict:
    """Score the text, print llama-perplexity's figures and append the run to the config's
    output file."""
    from braid.loader.tokenizer import load_tokenizer

    with open(config.text_file, encoding="utf-8", newline="") as f:
        text = f.read()  # as llama-perplexity reads it: "\r\n" kept
    chunks = make_chunks(load_tokenizer(engine.model, engine.cache), text, config.ctx_size,
                         config.chunks)
    print(f"{len(chunks.prompts)} chunks of {config.ctx_size} tokens, "
          f"{chunks.scored_per_chunk} scored in each, backend {config.backend}", flush=True)
    if config.backend == "braid":
        scored, duration = score_braid(chunks, engine)
    else:
        from braid.config import DTYPES
        from braid.loader.transformers_model import load_transformers_model

        model = load_transformers_model(engine.model, DTYPES[engine.dtype])
        scored, duration = score_transformers(chunks, model)
    perplexity = Perplexity()
    for logprobs in scored:
        perplexity.add(logprobs)
    tokens_per_s = len(chunks.prompts) * config.ctx_size / duration
    print(f"Final estimate: PPL = {perplexity.value:.4f} +/- {perplexity.error:.5f} "
          f"({perplexity.count} tokens scored; {tokens_per_s:.1f} prompt tokens/s)")
    row = {"eval": "perplexity", **describe_run(config.backend, engine),
           "text_file": config.text_file, "ctx_size": config.ctx_size,
           "chunks": len(chunks.prompts), "scored_tokens": perplexity.count,
           "perplexity": perplexity.value, "error": perplexity.error,
           "duration_s": duration, "prompt_tokens_per_s": tokens_per_s}
    append_row(config.output_file, row)
    return row
