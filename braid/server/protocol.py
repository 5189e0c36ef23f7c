"""The OpenAI API's request bodies, as pydantic models, their translation into
`SamplingParams`, and the limits a request must keep.

The models the server publishes (`bounded_models`) carry the limits of the running server and
model (token ids below the vocabulary, stop strings bounded in count and length, ...), so its
`/openapi.json` states what it checks. Unknown fields are ignored, as OpenAI-compatible
servers do, except the ones that would change the output and that braid does not implement:
those are refused by name (`unsupported_field`), never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, create_model

from braid.config import UserError
from braid.engine.request import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of `braid serve`, checked before any work starts; each is a
    flag of `braid serve`."""

    max_request_bytes: int = 4 << 20  # a body beyond: 413, before it is parsed
    max_sequences_per_request: int = 1024  # prompts x n of one request
    max_queued_sequences: int = 4096  # waiting to be admitted, all requests: beyond, 429
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_token_ids: int = 1024  # entries of stop_token_ids and of logit_bias

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.max_sequences_per_request > self.max_queued_sequences:
            raise ValueError("--max-sequences-per-request must not exceed "
                             "--max-queued-sequences (such a request could never queue)")


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields that completions and chat share (OpenAI's, plus vLLM's usual extensions)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # extras: see unsupported_field

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off; beyond the vocabulary: off
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0],
                                      le=REPETITION_PENALTY_RANGE[1])
    skip_special_tokens: bool = True
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None \
        = None  # token id (as a string) -> added to its logit
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    def sampling_params(self, max_new_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """The engine's parameters (OpenAI's defaults where a field is absent)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit():
                raise UserError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            bias[int(key)] = value
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            min_p=self.min_p or 0.0,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop=self.stop or (),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=min(self.min_tokens, max_new_tokens),
            n=self.n,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=bias,
            cache_salt=self.cache_salt,
        )


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # null: as many as the context leaves
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # tool calls, names: passed to the template

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(OpenAIModel):
    """`POST /tokenize`: a prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(OpenAIModel):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


class RequestModels(NamedTuple):
    """The request bodies of one server, with its limits in their schemas."""

    completion: type[CompletionRequest]
    chat: type[ChatCompletionRequest]
    tokenize: type[TokenizeRequest]
    detokenize: type[DetokenizeRequest]


def bounded_models(limits: RequestLimits, vocab_size: int, max_context: int) -> RequestModels:
    """Request models whose fields carry `limits` and the model's vocabulary and context."""
    token = Annotated[int, Field(ge=0, lt=vocab_size)]
    tokens = Annotated[list[token], Field(max_length=max_context)]
    many = Field(max_length=limits.max_sequences_per_request)
    stop = Annotated[str, Field(min_length=1, max_length=limits.max_stop_string_chars)]
    bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
    sampling: dict[str, Any] = dict(
        stop=(stop | Annotated[list[stop], Field(max_length=limits.max_stop_strings)] | None,
              None),
        stop_token_ids=(Annotated[list[token], Field(max_length=limits.max_token_ids)] | None,
                        None),
        logit_bias=(Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], bias],
                              Field(max_length=limits.max_token_ids)] | None, None),
        n=(int, Field(1, ge=1, le=min(128, limits.max_sequences_per_request))),
        min_tokens=(int, Field(0, ge=0, le=max_context)),
    )
    max_tokens = Annotated[int, Field(ge=1, le=max_context)] | None
    completion = create_model(
        "CompletionRequest", __base__=CompletionRequest, **sampling,
        prompt=(str | Annotated[list[str], many] | tokens | Annotated[list[tokens], many], ...),
        max_tokens=(max_tokens, 16))
    chat = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest, **sampling,
                        max_tokens=(max_tokens, None), max_completion_tokens=(max_tokens, None))
    detokenize = create_model("DetokenizeRequest", __base__=DetokenizeRequest,
                              tokens=(tokens, ...))
    return RequestModels(completion, chat, TokenizeRequest, detokenize)


# Fields of OpenAI's API, and of vLLM's and SGLang's, that change what is generated and that
# braid does not implement, with the values that ask for nothing (accepted).
_NOT_IMPLEMENTED: dict[str, tuple] = {
    "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "suffix": (None, ""), "best_of": (None, 1), "use_beam_search": (None, False),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,), "regex": (None,), "ebnf": (None,),
    "json_schema": (None,), "audio": (None,), "prediction": (None,),
    "web_search_options": (None,), "modalities": (None, ["text"]),
    "truncate_prompt_tokens": (None,), "lora_path": (None,), "reasoning_effort": (None,),
    "include_stop_str_in_output": (None, False), "allowed_token_ids": (None,),
    "bad_words": (None, []), "prompt_logprobs": (None,), "logits_processors": (None,),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "no_stop_trim": (None, False),
    "stop_regex": (None,), "echo": (None, False),  # echo: chat's (completions implement it)
}


def unsupported_field(body: BaseModel) -> str | None:
    """The first field of `body` that asks for something braid does not implement."""
    for name, value in (body.model_extra or {}).items():
        if name in _NOT_IMPLEMENTED and value not in _NOT_IMPLEMENTED[name]:
            return name
    return None


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error",
                    "server_error"]


def error_body(message: str, type_: ErrorType = "invalid_request_error",
               param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
