"""Constrained decoding: what a request constrains its output to (`StructuredOutputs`), and the
per-sequence grammar matchers that turn it into a token bitmask for each step (`Grammars`).

llguidance does the grammar work (see docs/performance.md, "Structured outputs", for why it
and not xgrammar): a constraint becomes an llguidance grammar when the request is made, so a
bad schema or pattern is the request's error before anything runs; the engine compiles it once
per text (cached) and gives each sequence its own matcher. The driver fills the next step's
bitmask while the ranks run the forward step; rank 0 applies it before sampling (see
`EngineCore.step` and `sampler.apply_grammar_mask`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from braid.errors import UserError

# Compact JSON with the separators of Python's json.dumps. Flexible whitespace lets a small model
# spend its tokens on newlines and indentation, and sometimes never close the object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILED_GRAMMARS_KEPT = 256  # distinct grammar texts whose compiled matcher is kept


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on a completion's text: exactly one of a JSON schema (`json`, a dict or its
    text), any JSON object (`json_object`), a regular expression (`regex`, Rust regex syntax),
    one of fixed strings (`choice`) or a grammar (`grammar`: Lark, or llama.cpp's GBNF, as
    vLLM's `structured_outputs` and SGLang's `ebnf` take it).

    The llguidance grammar is made and checked at construction: an invalid schema, pattern or
    grammar is a `UserError` naming `source` (the API field it came from).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    source: str = "structured_outputs"
    # Where the output reasons first (a reasoning model's `<think>` block): "inside" (the
    # prompt opened the block) or "opens" (the output may open one); the constraint then
    # applies to the answer after `</think>` (None: to the whole output)
    reasoning: str | None = None
    compiled: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] * self.json_object)
        if len(given) != 1:
            raise UserError(f"{self.source}: give exactly one constraint, got "
                            f"{', '.join(given) or 'none'}", self.source)
        grammar = self._to_grammar(given[0])
        if self.reasoning is not None:
            grammar = after_reasoning(grammar, self.reasoning)
        object.__setattr__(self, "compiled", grammar)

    @property
    def describes_answer(self) -> bool:
        """Whether the constraint describes the answer alone (a schema, a JSON object, a
        choice), not the raw output (a regular expression or a grammar, which a client writes
        knowing the output's text, think block and all)."""
        return self.regex is None and self.grammar is None

    def _to_grammar(self, kind: str) -> str:
        from llguidance import LLMatcher, grammar_from

        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else self.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema must be an object")
                grammar = LLMatcher.grammar_from_json_schema(closed_objects(schema),
                                                             defaults=JSON_OPTIONS)
            elif kind == "choice":
                if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                    raise ValueError("choice must be a non-empty list of non-empty strings")
                grammar = grammar_from("choice", list(self.choice))
            else:
                grammar = grammar_from(kind, getattr(self, kind))
            failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
            if failed:
                raise ValueError((messages or ["rejected"])[0].strip())
        except Exception as e:  # noqa: BLE001 - ValueError mostly; whatever it is, the
            # constraint's own fault: the request fails, not the server
            raise UserError(f"{self.source}: invalid {kind}: {e}", self.source) from None
        return grammar


def after_reasoning(grammar: str, reasoning: str) -> str:
    """`grammar` (llguidance's: Lark text, or its JSON list of grammars) applied after a
    reasoning block: any text up to the first `</think>` (lazy, so the block ends there),
    opened by `<think>` where the output may open it ("opens"; or go straight to the
    answer), or already open ("inside")."""
    if grammar.lstrip().startswith("{"):
        grammars = json.loads(grammar)["grammars"]
    else:
        grammars = [{"lark_grammar": grammar}]
    grammars[0]["name"] = "answer"
    head = ('start: /[ \\n]*/ "<think>" thought @answer | @answer' if reasoning == "opens"
            else "start: thought @answer")
    lark = f"{head}\nthought[lazy]: /(?s:.*)<\\/think>/"
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": lark}, *grammars]})


# Keywords whose value is a subschema, a list of them, or a map of names to them. Not allOf:
# its branches describe one object together, and closing each would refuse the others' keys.
_SUBSCHEMA = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else",
              "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def closed_objects(schema):
    """`schema` with `additionalProperties: false` on every object schema that lists its
    `properties` and says nothing about others: xgrammar's strict mode, the default of SGLang
    and vLLM. By the letter of JSON Schema such an object takes any other key, and a small
    model, free to add keys, may never close it (a pydantic model's schema omits the rule)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if (isinstance(out.get("properties"), dict) and "additionalProperties" not in out
            and "unevaluatedProperties" not in out and "allOf" not in out):
        out["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(item) for item in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(item) for name, item in out[key].items()}
    return out


@dataclass
class GrammarTimes:
    """Where constrained decoding spent time (totals since start, for `/metrics`): masks
    filled by the driver while the step ran, and how long rank 0 then waited for them."""

    masks: int = 0  # token masks filled (one per constrained sequence per step)
    fill_s: float = 0.0
    wait_s: float = 0.0


class Grammars:
    """The engine's grammar matchers: compiled once per grammar text (kept most recently used
    first), one matcher per constrained sequence, and the token bitmask of a step.

    `load_tokenizer` gives the model's Hugging Face tokenizer; it is called (and converted for
    llguidance: docs/performance.md, "Structured outputs") at the first constrained request, so
    engines that never see one never pay for it.
    """

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int,
                 eos_token_ids: Callable[[object], frozenset[int]]) -> None:
        self._load_tokenizer = load_tokenizer
        self._eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._tokenizer = None
        self._executor = None
        self._lock = threading.Lock()  # the tokenizer is converted once, maybe in a thread
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._cache_lock = threading.Lock()  # `_compiled`, also filled by the grammar thread
        self._pool: ThreadPoolExecutor | None = None  # the grammar thread (`compile_aside`)
        self.times = GrammarTimes()

    def prepare_in_background(self) -> None:
        """Convert the tokenizer in a thread now (a server: the first constrained request
        then does not stall the running sequences' steps)."""
        threading.Thread(target=self._llg_tokenizer, name="braid-grammar-tokenizer",
                         daemon=True).start()

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance
                import llguidance.hf

                hf = self._load_tokenizer()
                self._executor = llguidance.LLExecutor()
                self._tokenizer = llguidance.hf.from_tokenizer(
                    hf, n_vocab=self.vocab_size, eos_token=sorted(self._eos_token_ids(hf)))
        return self._tokenizer

    def matcher(self, structured: StructuredOutputs):
        """A fresh matcher for one sequence (`UserError` if the grammar does not compile for
        this model's vocabulary)."""
        return self._template(structured).deep_copy()

    def is_compiled(self, structured: StructuredOutputs) -> bool:
        """Whether `matcher` would find the grammar compiled (it then takes no time)."""
        with self._cache_lock:
            return structured.compiled in self._compiled

    def compile_aside(self, structured: StructuredOutputs) -> Future:
        """Compile the grammar in the grammar thread (a large schema takes a large fraction of
        a second, mostly without Python's lock); the future's exception is `matcher`'s
        `UserError`, and once it is done `matcher` finds the grammar compiled."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="braid-grammar")
        return self._pool.submit(self._template, structured)

    def _template(self, structured: StructuredOutputs):
        from llguidance import LLMatcher

        text = structured.compiled
        with self._cache_lock:
            template = self._compiled.get(text)
        if template is None:
            template = LLMatcher(self._llg_tokenizer(), text, log_level=0)
            if template.is_error():
                raise UserError(f"{structured.source}: {template.get_error()}",
                                structured.source)
        with self._cache_lock:
            self._compiled[text] = template
            self._compiled.move_to_end(text)
            if len(self._compiled) > COMPILED_GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        return template

    def fill(self, matchers: list) -> tuple[np.ndarray, dict[int, str]]:
        """The next token's bitmask of each matcher ([G, words] int32, bit t of a row set where
        token t is allowed), and the rows whose matcher failed (grammar errors, resource
        limits): those rows allow every token and must not be sampled. Never raises: rank 0
        waits for this mask."""
        start = time.perf_counter()
        mask = np.full((len(matchers), self.words), -1, dtype=np.int32)
        errors = {i: m.get_error() for i, m in enumerate(matchers) if m.is_error()}
        live = [(m, i) for i, m in enumerate(matchers) if i not in errors]
        try:
            if live:
                self._executor.unsafe_compute_mask_ptr(live, mask.ctypes.data,
                                                       self.words * 4, len(matchers))
        except Exception as e:  # noqa: BLE001 - an API misuse: fail these rows, not the engine
            errors.update({i: f"{type(e).__name__}: {e}" for _, i in live})
        errors.update({i: m.get_error() for m, i in live if m.is_error()})
        mask[list(errors)] = -1
        self.times.masks += len(matchers)
        self.times.fill_s += time.perf_counter() - start
        return mask, errors


class GrammarRefused(UserError):
    """A request's grammar refused a token its own mask allowed (llguidance computes both; an
    exotic constraint, such as a regex of C1 control characters, can make them disagree): the
    request's constraint cannot be followed with this tokenizer, its own error (a 400 naming
    the constraint's field)."""


def accept_token(matcher, token: int, source: str = "structured_outputs") -> bool:
    """Advance a sequence's matcher by its sampled token; whether the grammar is now complete
    (nothing else may follow). `GrammarRefused`, naming `source` (the constraint's API field),
    if the grammar refuses the token."""
    if not matcher.consume_token(token):
        # llguidance's error dumps the parser's state; its last "Error:" line says why
        reason = next((line for line in reversed(matcher.get_error().splitlines())
                       if line.startswith("Error:")), "")
        raise GrammarRefused(f"{source}: the constraint cannot be followed with this model's "
                             f"tokenizer: its grammar refused token {token}, which it allowed. "
                             f"{reason}", source)
    return matcher.is_stopped()
