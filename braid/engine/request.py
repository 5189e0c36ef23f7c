"""What a request asks for (`SamplingParams`, `Request`), whether it can ever run
(`check_request`), and the per-sequence state the scheduler tracks (`Sequence`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from braid.engine.grammar import StructuredOutputs
from braid.errors import UserError
from braid.loader.model_config import ModelConfig
from braid.settings import setting
from braid.step import TokenLogprob

# Most alternatives per token that `logprobs` may ask for (OpenAI's limit for top_logprobs).
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias: -100 bans, 100 forces
_INT64 = 1 << 63
_TOP_K_NO_LIMIT = 1 << 31  # top_k beyond any vocabulary: no limit (kept in an int64 array)
# Sampling runs in float32: a temperature below this is greedy (vLLM's rule; dividing by it
# would overflow), and a repetition penalty is kept within a range whose divisions stay finite.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
POOLINGS = (None, "last", "mean")  # how an embedding pools the prompt's hidden states


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's meanings and defaults).

    `logprobs`: the chosen token's logprob plus this many top alternatives per generated token
    (None: no logprobs); `prompt_logprobs` the same for every prompt token after the first;
    `logprob_token_ids`: the logprobs of these tokens at every generated position, whatever
    their rank (SGLang's `token_ids_logprob`: how a multiple-choice evaluator reads the
    likelihood of each answer letter).
    Logprobs are the model's own (log-softmax of the raw logits, before penalties, biases,
    grammar masks and temperature). `structured` constrains the output (`StructuredOutputs`:
    a JSON schema, a regex, a choice or a grammar). `logit_bias` adds to a token's logit
    before sampling (OpenAI's, in [-100, 100]); `cache_salt` keeps a tenant's prompts out of
    other tenants' prefix-cache blocks (vLLM's). `stop` strings end a completion, and are cut
    from its text, by whichever front end detokenizes (`LLM`, the server).
    """

    # The settings `braid generate` takes as flags
    max_new_tokens: int = setting(128, "tokens to generate per prompt")
    temperature: float = setting(1.0, "0 for greedy")
    top_p: float = setting(1.0, "sample from the smallest set of tokens this likely")
    top_k: int = setting(0, "sample from this many most likely tokens (0: no limit)")
    min_p: float = 0.0
    seed: int | None = setting(None, "sampling seed (default: a fresh one per run)")
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    n: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    structured: StructuredOutputs | None = None  # JSON schema, regex, choice or grammar
    # Embed the prompt instead of generating: its final hidden states pooled ("last" token or
    # "mean" of all), returned as the sequence's `embedding`
    pooling: str | None = None

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids", "logprob_token_ids"):  # lists welcome; tuples kept
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.top_k >= _TOP_K_NO_LIMIT:
            object.__setattr__(self, "top_k", 0)
        if 0 < self.temperature < GREEDY_BELOW_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")
        for name in floats:
            if not math.isfinite(getattr(self, name)):
                raise UserError(f"{name} must be a finite number, got {getattr(self, name)!r}",
                                name)
        checks = [
            (self.max_new_tokens >= 1, "max_new_tokens", "at least 1"),
            (0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
             f"in [0, {MAX_TEMPERATURE:g}]"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (self.top_k >= 0, "top_k", ">= 0 (0 disables it)"),
            (0 <= self.min_p <= 1, "min_p", "in [0, 1]"),
            (self.seed is None or -_INT64 <= self.seed < _INT64, "seed", "a 64-bit integer"),
            (self.min_tokens >= 0, "min_tokens", ">= 0"),
            (self.min_tokens <= self.max_new_tokens, "min_tokens", "at most max_new_tokens"),
            (self.n >= 1, "n", "at least 1"),
            (REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty
             <= REPETITION_PENALTY_RANGE[1], "repetition_penalty",
             "in [{:g}, {:g}]".format(*REPETITION_PENALTY_RANGE)),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             "prompt_logprobs", f"in [0, {MAX_LOGPROBS}]"),
            (self.pooling in POOLINGS, "pooling", " or ".join(map(repr, POOLINGS))),
            (self.pooling is None or (self.n == 1 and self.prompt_logprobs is None
                                      and self.structured is None), "pooling",
             "without n, prompt_logprobs or an output constraint (nothing is generated)"),
            (all(self.stop), "stop", "non-empty strings"),
            (all(abs(b) <= MAX_LOGIT_BIAS for _, b in self.logit_bias), "logit_bias",
             f"a map of token ids to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise UserError(f"{name} must be {rule}, got {getattr(self, name)!r}", name)

    @property
    def penalized(self) -> bool:
        """Whether sampling needs the sequence's token history."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass
class Request:
    """One tokenized request as the engine core receives it; `n` sequences are generated."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()  # the front end's tokenizer knows them
    arrival_time: float = field(default_factory=time.monotonic)
    # Admission takes turns between groups (the server's HTTP requests; default: this
    # request alone), so one client's many prompts do not hold back another's one.
    group: str | None = None


@dataclass(eq=False)  # compared by identity: the scheduler's queues hold the objects
class Sequence:
    """One of a request's `n` completions: its tokens, KV blocks and progress."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    group: str = ""  # whose turn admission takes (`Request.group`)
    skipped_since: float | None = None  # when admission first passed it over (time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    block_keys: list[tuple[bytes, bytes]] = field(default_factory=list)  # kv_cache.BlockKey
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_computed: int = 0  # tokens whose keys and values are in the cache
    num_cached_prompt: int = 0  # prompt tokens found in the prefix cache at admission
    scheduled_tokens: int = 0  # tokens the current step computes
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # for tokens 1, 2, ...
    finish_reason: str | None = None
    grammar: object | None = None  # the llguidance matcher of `params.structured`
    # Speculative decoding: tokens proposed to follow the last one, verified by the next step
    # (`plan.build_plan`), and the proposer's state for this sequence (`speculation`)
    draft: list[int] = field(default_factory=list)
    speculation: object | None = None
    pooled: np.ndarray | None = None  # an embedding's pooled hidden states so far (fp32)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence (the
        scheduler asks for the newest token of every sequence at every decode step)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:end] + self.output_ids[:max(0, end - n)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether this sequence computes its request's prompt logprobs (completion 0 does;
        its siblings share them, and may share the prompt's cached blocks)."""
        return self.params.prompt_logprobs is not None and self.index == 0

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position must be computed (no cached prefix): prompt logprobs
        score each, a mean embedding pools each."""
        return ((self.scores_prompt and len(self.prompt_logprobs) < len(self.prompt_ids) - 1)
                or self.params.pooling == "mean")

    @property
    def prompt_done(self) -> bool:
        """Whether the whole prompt is in the cache (siblings may then share its blocks)."""
        return self.num_computed >= len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def check_request(prompt_ids: list[int], params: SamplingParams, model_config: ModelConfig,
                  kv_capacity: int) -> None:
    """Raise `UserError` (naming the field at fault) if a request can never run: an empty
    prompt, a token outside the vocabulary (in the prompt, `stop_token_ids`, `logit_bias` or
    `logprob_token_ids`), or a prompt that with its `max_new_tokens` exceeds the model's
    context or the KV cache."""
    context = model_config.max_position_embeddings
    n = len(prompt_ids)
    if not prompt_ids:
        raise UserError("a prompt must have at least one token", "prompt")
    vocab = model_config.vocab_size
    for name, ids in (("prompt", prompt_ids), ("stop_token_ids", params.stop_token_ids),
                      ("logit_bias", [t for t, _ in params.logit_bias]),
                      ("logprob_token_ids", params.logprob_token_ids)):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UserError(f"{name}: token id {bad[0]} is outside the vocabulary "
                            f"(0..{vocab - 1})", name)
    if n >= context:
        raise UserError(f"prompt of {n} tokens does not fit the model's context of {context} "
                        "tokens", "prompt")
    total = n + params.max_new_tokens
    if total > context:
        raise UserError(f"prompt of {n} tokens plus {params.max_new_tokens} new tokens exceeds "
                        f"the model's context of {context} tokens; ask for at most "
                        f"{context - n} new tokens", "max_tokens")
    if total > kv_capacity:
        raise UserError(f"prompt of {n} tokens plus {params.max_new_tokens} new tokens exceeds "
                        f"the KV cache ({kv_capacity} tokens); raise --max-total-tokens or ask "
                        "for fewer tokens", "max_tokens")
