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
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    create_model,
)

from braid import settings
from braid.engine.grammar import StructuredOutputs
from braid.engine.request import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
)
from braid.errors import UserError
from braid.server.tool_calls import named_tool_schema, required_tools_schema
from braid.settings import setting


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of `braid serve`, checked before any work starts; each is a
    flag of `braid serve`."""

    max_request_bytes: int = setting(
        4 << 20, "largest request body; beyond, 413 before it is parsed", metavar="N",
        at_least=1)
    max_sequences_per_request: int = setting(
        1024, "most completions (prompts x n) one request may ask for", metavar="N", at_least=1)
    max_queued_sequences: int = setting(
        4096, "most sequences waiting for admission; beyond, 429 with Retry-After", metavar="N",
        at_least=1)
    max_stop_strings: int = setting(16, "most stop strings a request may give", metavar="N",
                                    at_least=1)
    max_stop_string_chars: int = setting(256, "longest stop string, in characters",
                                         metavar="N", at_least=1)
    max_token_ids: int = setting(1024, "most entries of stop_token_ids and of logit_bias",
                                 metavar="N", at_least=1)

    def __post_init__(self) -> None:
        settings.check(self)
        if self.max_sequences_per_request > self.max_queued_sequences:
            raise UserError("--max-sequences-per-request must not exceed "
                            "--max-queued-sequences (such a request could never queue)")


MAX_TOOLS = 128  # functions one chat request may offer


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


_NULL = {"type": "null"}  # JSON Schema's null


def _drop_null(value: dict) -> None:
    """Leave null (and a null default) out of a property's schema."""
    value["anyOf"] = [option for option in value.get("anyOf", ()) if option != _NULL]
    if value.get("default", 0) is None:
        del value["default"]


class StreamOptions(OpenAIModel):
    include_usage: bool = False


NonEmptyStr = Annotated[str, Field(min_length=1)]
Choices = Annotated[list[NonEmptyStr], Field(min_length=1)]


class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: OpenAI's named schema."""

    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(OpenAIModel):
    type: Literal["text"]


class JsonObjectFormat(OpenAIModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(OpenAIModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


# `response_format`: free text, any JSON object, or JSON following a schema
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat,
                           Field(discriminator="type")]


def _exactly_one(schema: dict) -> None:
    """An object schema that takes exactly one of its properties, not null (the server reads
    null as absent, and ignores unknown keys: the schema leaves both out)."""
    for value in schema["properties"].values():
        _drop_null(value)
    schema.update(minProperties=1, maxProperties=1, additionalProperties=False)


class StructuredOutputsField(OpenAIModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    model_config = ConfigDict(json_schema_extra=_exactly_one)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: Literal[True] | None = None


class RequestBody(OpenAIModel):
    """A request body. Its published schema (`/openapi.json`) names the served model and says
    what the server checks across fields, which pydantic's schema of each field cannot
    (`publish`), so that what a client generates from the schema is what the server accepts.
    Where a rule between fields needs it, the schema is stricter than the server (a null that
    the server reads as absent is left out of it)."""

    served_model: ClassVar[str | None] = None  # set by `bounded_models`

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler) -> dict:
        schema = handler.resolve_ref_schema(handler(core_schema))
        cls.publish(schema)
        return schema

    @classmethod
    def publish(cls, schema: dict) -> None:
        """Add to `schema` (this model's, as pydantic writes it) the rules the server
        checks."""
        if cls.served_model is not None:
            schema["properties"]["model"] = {
                "anyOf": [{"const": cls.served_model}, _NULL], "title": "Model"}


# The fields that constrain the output; a request gives one at most (`SamplingFields.structured`)
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "regex", "ebnf", "json_schema")


def _one_at_most(schema: dict, fields: tuple[str, ...]) -> None:
    """Make `schema` allow one of `fields` at most: each, when given, excludes the others (and
    may not be null, which the server reads as absent)."""
    dependent = schema.setdefault("dependentSchemas", {})
    for field in fields:
        _drop_null(schema["properties"][field])
        dependent[field] = {"properties": {other: False for other in fields if other != field}}


# /openapi.json writes bounds as floats, and 2**63 - 1 would round up to 2**63, a seed the server
# refuses: the schema states the largest int64 range whose ends are floats
_SEED_SCHEMA = {"type": "integer", "minimum": -(1 << 63) + 1024, "maximum": (1 << 63) - 1024}


class SamplingFields(RequestBody):
    """Fields that completions and chat share (OpenAI's, plus vLLM's usual extensions)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # extras: see unsupported_field

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off; beyond the vocabulary: off
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Annotated[int, Field(ge=-(1 << 63), lt=1 << 63),  # any int64; the schema says
                    WithJsonSchema(_SEED_SCHEMA)] | None = None  # a range it states exactly
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
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    # Constraints on the output: OpenAI's, vLLM's (and its older guided_*), SGLang's
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None  # SGLang's: the schema as JSON text

    constraint_fields: ClassVar[tuple[str, ...]] = CONSTRAINT_FIELDS

    @classmethod
    def publish(cls, schema: dict) -> None:
        super().publish(schema)
        _one_at_most(schema, cls.constraint_fields)

    def structured(self) -> StructuredOutputs | None:
        """The request's output constraint, from whichever field gives it (`UserError`,
        naming the field, for an invalid one or for more than one)."""
        given: list[tuple[str, dict]] = []
        fmt = self.response_format
        if isinstance(fmt, JsonObjectFormat):
            given.append(("response_format", {"json_object": True}))
        elif isinstance(fmt, JsonSchemaResponseFormat):
            given.append(("response_format", {"json": fmt.json_schema.schema_}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs",
                          self.structured_outputs.model_dump(exclude_none=True, by_alias=True)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                          ("regex", "regex"), ("ebnf", "grammar"), ("json_schema", "json")):
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        if not given:
            return None
        if len(given) > 1:
            raise UserError(f"{given[1][0]}: give one output constraint, not "
                            f"{' and '.join(name for name, _ in given)}", given[1][0])
        source, constraint = given[0]
        return StructuredOutputs(**constraint, source=source)

    def sampling_params(self, max_new_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """The engine's parameters (OpenAI's defaults where a field is absent); the prompt
        is scored for `prompt_logprobs` alternatives or the request's, whichever is more."""
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
            prompt_logprobs=max((k for k in (prompt_logprobs, self.prompt_logprobs)
                                 if k is not None), default=None),
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=bias,
            cache_salt=self.cache_salt,
            structured=self.structured(),
        )


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # null: as many as the context leaves
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(OpenAIModel):
    """A content part of a message: text only (braid serves text models: an image would
    change the answer)."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # tool calls, names: passed to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str | None:
        """The content as the chat template takes it: text parts joined."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class FunctionDefinition(OpenAIModel):
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    """An entry of `tools` (OpenAI's: functions only)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    """The function a named `tool_choice` forces."""

    name: str


class NamedToolChoice(OpenAIModel):
    """`tool_choice` naming one function: the output is a call of it."""

    type: Literal["function"] = "function"
    function: FunctionName


# apply_chat_template's own arguments, which a request's template variables may not replace
_TEMPLATE_ARGUMENTS = ("conversation", "messages", "tools", "documents", "chat_template",
                       "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                       "truncation", "max_length", "return_tensors", "return_dict",
                       "return_assistant_tokens_mask", "tokenizer_kwargs")


def _template_variables(value: dict) -> dict:
    taken = [name for name in value if name in _TEMPLATE_ARGUMENTS]
    if taken:
        raise ValueError(f"{taken[0]!r} is not a template variable a request may set")
    return value


# Variables for the chat template (vLLM's `chat_template_kwargs`: `enable_thinking`, say)
TemplateKwargs = Annotated[
    dict[str, Any], AfterValidator(_template_variables), Field(max_length=64),
    WithJsonSchema({"type": "object", "maxProperties": 64,
                    "propertyNames": {"not": {"enum": list(_TEMPLATE_ARGUMENTS)}}})]


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    # OpenAI's default: "auto" with tools, "none" without
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: TemplateKwargs | None = None

    # tool_choice "required" or a named function constrains the output too (the schema is
    # stricter: any tool_choice excludes the other constraints)
    constraint_fields: ClassVar[tuple[str, ...]] = CONSTRAINT_FIELDS + ("tool_choice",)
    auto_tool_calls: ClassVar[bool] = True  # whether the server reads "auto" tool calls

    @classmethod
    def publish(cls, schema: dict) -> None:
        super().publish(schema)
        properties = schema["properties"]
        # Calls of no tool cannot be made; without a parser, tools need a tool_choice other
        # than "auto" (its default)
        _drop_null(properties["tools"])
        properties["tools"]["anyOf"][0]["minItems"] = 1
        schema["dependentRequired"] = {"tool_choice": ["tools"]}
        if not cls.auto_tool_calls:
            schema["dependentRequired"]["tools"] = ["tool_choice"]
            properties["tool_choice"]["anyOf"] = [
                {"enum": ["none", "required"]} if "enum" in option else option
                for option in properties["tool_choice"]["anyOf"]]
        schema["dependentSchemas"]["top_logprobs"] = {  # top_logprobs: with logprobs
            "required": ["logprobs"], "properties": {"logprobs": {"const": True}}}

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named" (`tool_choice` with its default: "auto"
        with tools, "none" without, as without tools "auto" can call none)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if self.tool_choice in (None, "auto"):
            return "auto" if self.tools else "none"
        return self.tool_choice

    def structured(self) -> StructuredOutputs | None:
        """As for completions, plus the constraint of `tool_choice` "required" or a named
        function: the output is the calls' JSON (`tool_calls`)."""
        constraint = super().structured()
        mode = self.tool_mode
        if mode in ("none", "auto"):
            return constraint
        if not self.tools:
            raise UserError(f"tool_choice {mode!r} needs `tools`", "tool_choice")
        if constraint is not None:
            raise UserError(f"tool_choice {mode!r} constrains the output already: leave out "
                            f"{constraint.source}", constraint.source)
        try:
            schema = (named_tool_schema(self.tool_dicts(), self.tool_choice.function.name)
                      if mode == "named" else required_tools_schema(self.tool_dicts()))
        except Exception as e:  # noqa: BLE001 - ValueError mostly: the tools' own fault
            raise UserError(f"tool_choice: {e}", "tool_choice") from None
        if mode == "required" and self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema, source="tools")

    def tool_dicts(self) -> list[dict]:
        """`tools` as the chat template and the tool-call schemas take them."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]


class TokenizeRequest(RequestBody):
    """`POST /tokenize`: a prompt, or chat messages through the template (exactly one)."""

    model: str | None = None
    prompt: str = Field(None, min_length=1)  # None: not given (null is refused)
    messages: list[ChatMessage] = Field(None, min_length=1)
    add_special_tokens: bool = True
    chat_template_kwargs: TemplateKwargs | None = None

    @classmethod
    def publish(cls, schema: dict) -> None:
        super().publish(schema)
        schema["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]
        for name in ("prompt", "messages"):
            del schema["properties"][name]["default"]


class DetokenizeRequest(RequestBody):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


class RequestModels(NamedTuple):
    """The request bodies of one server, with its limits in their schemas."""

    completion: type[CompletionRequest]
    chat: type[ChatCompletionRequest]
    tokenize: type[TokenizeRequest]
    detokenize: type[DetokenizeRequest]


def bounded_models(limits: RequestLimits, vocab_size: int, max_context: int,
                   served_model: str | None = None, auto_tool_calls: bool = True
                   ) -> RequestModels:
    """Request models whose fields carry `limits` and the model's vocabulary and context, and
    whose schemas name `served_model` and say whether tool_choice "auto" is served."""
    token = Annotated[int, Field(ge=0, lt=vocab_size)]
    tokens = Annotated[list[token], Field(max_length=max_context)]
    prompt_ids = Annotated[list[token], Field(min_length=1, max_length=max_context)]
    many = Field(min_length=1, max_length=limits.max_sequences_per_request)
    stop = Annotated[str, Field(min_length=1, max_length=limits.max_stop_string_chars)]
    bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
    # The keys are token ids as text; the schema says which (pydantic's would say only digits)
    biases = Annotated[
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], bias],
        Field(max_length=limits.max_token_ids),
        WithJsonSchema({"type": "object", "propertyNames": {"pattern": _decimal_below(vocab_size)},
                        "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                 "maximum": MAX_LOGIT_BIAS},
                        "maxProperties": limits.max_token_ids})]
    sampling: dict[str, Any] = dict(
        stop=(stop | Annotated[list[stop], Field(max_length=limits.max_stop_strings)] | None,
              None),
        stop_token_ids=(Annotated[list[token], Field(max_length=limits.max_token_ids)] | None,
                        None),
        logit_bias=(biases | None, None),
        n=(int, Field(1, ge=1, le=min(128, limits.max_sequences_per_request))),
        min_tokens=(int, Field(0, ge=0, le=max_context)),
    )
    max_tokens = Annotated[int, Field(ge=1, le=max_context)] | None
    completion = create_model(
        "CompletionRequest", __base__=CompletionRequest, **sampling,
        prompt=(NonEmptyStr | Annotated[list[NonEmptyStr], many] | prompt_ids
                | Annotated[list[prompt_ids], many], ...),
        max_tokens=(max_tokens, 16))
    chat = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest, **sampling,
                        max_tokens=(max_tokens, None), max_completion_tokens=(max_tokens, None))
    chat.auto_tool_calls = auto_tool_calls
    tokenize = create_model("TokenizeRequest", __base__=TokenizeRequest)
    detokenize = create_model("DetokenizeRequest", __base__=DetokenizeRequest,
                              tokens=(tokens, ...))
    for body in (completion, chat, tokenize, detokenize):
        body.served_model = served_model
    return RequestModels(completion, chat, tokenize, detokenize)


def _decimal_below(n: int) -> str:
    """A regular expression of the decimal numbers 0 to n - 1 (no leading zeros)."""
    top = str(n - 1)
    options = ["0"] + [f"[1-9][0-9]{{{k}}}" for k in range(len(top) - 1)]
    for i, digit in enumerate(top):  # top's first i digits, a smaller digit, then any
        low = "1" if i == 0 else "0"
        if digit > low:
            options.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    return "^(" + "|".join(options + [top]) + ")$"


# Fields of OpenAI's API, and of vLLM's and SGLang's, that change what is generated and that
# braid does not implement, with the values that ask for nothing (accepted).
_NOT_IMPLEMENTED: dict[str, tuple] = {
    "functions": (None, []), "function_call": (None, "none"),
    "suffix": (None, ""), "best_of": (None, 1), "use_beam_search": (None, False),
    "guided_whitespace_pattern": (None,), "guided_decoding_backend": (None,),
    "structural_tag": (None,), "audio": (None,), "prediction": (None,),
    "web_search_options": (None,), "modalities": (None, ["text"]),
    "truncate_prompt_tokens": (None,), "lora_path": (None,), "reasoning_effort": (None,),
    "include_stop_str_in_output": (None, False), "allowed_token_ids": (None,),
    "bad_words": (None, []), "logits_processors": (None,),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "no_stop_trim": (None, False),
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
