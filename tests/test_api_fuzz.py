"""A property-based fuzz of `braid serve --tp 2` from its own OpenAPI schema (schemathesis):
every operation, first schemathesis' boundary cases, then random bodies, schema-valid and not.
No answer may be a 5xx, a dropped connection or a streamed `server_error` event, and the server
must still complete a prompt afterwards.

One test drives schemathesis from Python and collects every failure, so a run reports all of
them at once (each with the body that was sent and the server's exception) instead of stopping
at the first, and the fuzz stays one pytest item bounded in time (`FUZZ_BUDGET_S`). A property
test combines the output constraints with the fields that fight them (`CONSTRAINTS`), and a
slow one runs schemathesis' CLI as an outside user does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import hypothesis
import pydantic
import pytest
import requests
import schemathesis
from conftest import API_KEY
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from braid.server.anthropic import CountTokensRequest, MessagesRequest
from braid.server.embeddings import EmbeddingRequest
from braid.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from braid.server.responses_api import ResponsesRequest

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Wall-clock budget of all fuzz requests on a 2-core host (the server's start is the fixture's):
# BOUNDARY_SHARE of it to the boundary cases, the rest (and what they leave) to the random ones,
# whose phases stop at their share's end (the closing line counts them). Schema-valid random
# bodies for the generating operations reach the engine and take longest, so they get
# GENERATING_SHARE times the time of any other operation and mode.
FUZZ_BUDGET_S = 24
BOUNDARY_SHARE = 0.5
GENERATING_SHARE = 4
RANDOM_EXAMPLES = 100  # random cases per operation and generation mode (Hypothesis' max_examples)
# An answer slower than REQUEST_TIMEOUT_S is asked for again once, with SLOW_TIMEOUT_S: the caps
# below bound what a request generates, not its prompt, and a prompt of thousands of tokens (a
# long random string) may take longer than REQUEST_TIMEOUT_S to prefill on a 2-core host in
# fp32. No answer within SLOW_TIMEOUT_S is a hang.
REQUEST_TIMEOUT_S = 15
SLOW_TIMEOUT_S = 120
# Generation is the only costly thing a request can ask for, so generated bodies ask for little:
# `max_tokens` (and `max_completion_tokens`) above MAX_TOKENS become MAX_TOKENS and `n` above
# MAX_N becomes MAX_N, and a request without a limit, or with a null one, gets MAX_TOKENS (the
# server's default is 16 tokens for a completion and whatever the context leaves for a chat, and
# null is whatever the context leaves: thousands of steps). Values from REJECTED_FROM up
# exceed any context braid serves, so they are sent unchanged and must get a 400; values the
# schema rejects (0, -1, 129, "x") are also sent unchanged. What counts as a number is what the
# server's pydantic reads as one (lax: 7064.0 and "7064" are 7064).
MAX_TOKENS = 2  # a prefill and a decode step
MAX_N = 2
REJECTED_FROM = 1 << 20
MAX_SCHEMA_N = 128  # protocol.SamplingFields.n's bound
EXAMPLES_SHOWN = 3  # bodies the report shows of each kind of failure
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"
EMBEDDINGS_PATH = "/v1/embeddings"
GENERATING_PATHS = (COMPLETIONS_PATH, CHAT_PATH, MESSAGES_PATH, RESPONSES_PATH, EMBEDDINGS_PATH)
_INT = pydantic.TypeAdapter(int)
# The top-level fields each body model reads (the report leaves out the others, which the server
# ignores, so a reproducing body stays readable).
FIELDS = {COMPLETIONS_PATH: CompletionRequest, CHAT_PATH: ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
          MESSAGES_PATH: MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest,
          RESPONSES_PATH: ResponsesRequest, EMBEDDINGS_PATH: EmbeddingRequest}
# A streamed error event that is the server's fault, in OpenAI's, Anthropic's or the Responses
# API's shape
STREAMED_SERVER_ERROR = re.compile(
    r'"type":\s*"(server_error|api_error|overloaded_error)"|"code":\s*"server_error"')


@dataclass
class Failure:
    """One answer that broke the rule: what was sent, what came back, what the server logged."""

    method: str
    path: str
    content_type: str
    body: str  # as sent
    fields: str  # the fields the server reads, where the body is an object
    status: str
    text: str
    server_error: str

    def key(self) -> tuple:
        return self.method, self.path, self.status, self.server_error or self.text[:200]

    def __str__(self) -> str:
        shown = (f"    fields: {self.fields}\n    sent: {self.body[:300]}" if self.fields
                 else f"    body: {self.body[:600]}")
        return (f"{self.method} {self.path} -> {self.status}: {self.text[:300]!r}\n"
                f"    server: {self.server_error or '(nothing logged)'}\n"
                f"    content-type: {self.content_type}\n{shown}")


def _as_int(value) -> int | None:
    """`value` as the server reads an int field, or None where it reads none."""
    try:
        return _INT.validate_python(value)
    except pydantic.ValidationError:
        return None


def cheap(path: str, body):
    """`body` asking for at most MAX_TOKENS tokens and MAX_N completions (see MAX_TOKENS)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = _as_int(body.get(field))
        if value is not None and MAX_TOKENS < value < REJECTED_FROM:
            body[field] = MAX_TOKENS
    n = _as_int(body.get("n"))
    if n is not None and MAX_N < n <= MAX_SCHEMA_N:
        body["n"] = MAX_N
    limits = {COMPLETIONS_PATH: ("max_tokens",),
              CHAT_PATH: ("max_tokens", "max_completion_tokens"),
              RESPONSES_PATH: ("max_output_tokens",)}.get(path, ())
    if limits and all(body.get(field) is None for field in limits):
        body[limits[-1]] = MAX_TOKENS
    return body


def _fields(path: str, body) -> str:
    """The fields of `body` that the server reads, as JSON ('' where it reads no object)."""
    model = FIELDS.get(path)
    if model is None or not isinstance(body, dict):
        return ""
    return json.dumps({k: v for k, v in body.items() if k in model.model_fields})


def _shown(data: bytes | str | None) -> str:
    if data is None:
        return "(none)"
    if isinstance(data, bytes):
        return data.decode("utf-8", "backslashreplace")
    return data


def _server_exception(server, offset: int, text: str) -> str:
    """The last exception line the server logged after byte `offset` of its log. An unhandled
    exception (Starlette's plain-text 500) is logged after its 500 is sent: wait for it a
    little (the time counts against the budget)."""
    deadline = time.monotonic() + (1.0 if text == "Internal Server Error" else 0.0)
    while True:
        with open(server.log, "rb") as log:
            log.seek(offset)
            new = log.read().decode("utf-8", "replace")
        lines = re.findall(r"^[\w.]*(?:Error|Exception|Exit|Interrupt)\b.*$", new, re.MULTILINE)
        if lines or time.monotonic() > deadline:
            return lines[-1][:300] if lines else ""
        time.sleep(0.1)


def _usage(response) -> str:
    """The token counts an answer reports (how long its prompt was), or its start."""
    try:
        return json.dumps(response.json()["usage"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


class Fuzzer:
    """Sends cases to the server one at a time and keeps every failure."""

    def __init__(self, server, budget_s: float) -> None:
        self.server = server
        self.deadline = time.monotonic() + budget_s
        self.sent = 0
        self.skipped = 0  # drawn past the budget, or after the server died
        self.unencodable = 0
        self.slow: list[str] = []  # answers that took over REQUEST_TIMEOUT_S, and their prompts
        self.failures: list[Failure] = []
        self.statuses: Counter[tuple[str, str]] = Counter()  # (operation, status): answers

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def send(self, case: schemathesis.Case) -> None:
        """Send `case` (its body made `cheap`) and check the answer. No session is
        shared, so each request opens its own connection and a dropped one is never resent
        (schemathesis resends a request once on a reused keep-alive connection that drops)."""
        if self.out_of_time() or self.server.proc.poll() is not None:
            self.skipped += 1
            return
        if isinstance(case.body, dict):
            case.body = cheap(case.path, case.body)
        offset = self.server.log.stat().st_size
        try:
            try:
                response = case.call(base_url=self.server.base_url, headers=AUTH,
                                     timeout=REQUEST_TIMEOUT_S)
            except requests.exceptions.ReadTimeout:
                start = time.monotonic()
                response = case.call(base_url=self.server.base_url, headers=AUTH,
                                     timeout=SLOW_TIMEOUT_S)
                self.slow.append(f"{case.operation.label} {response.status_code} in "
                                 f"{time.monotonic() - start:.0f} s: {_usage(response)}")
        except schemathesis.errors.SerializationNotPossible:
            self.unencodable += 1  # a media type schemathesis cannot encode: nothing sent
            return
        except requests.RequestException as e:
            self.sent += 1
            request = e.request
            self._fail(case, request.headers.get("Content-Type", "") if request else "",
                       request.body if request else None, "no answer",
                       f"{type(e).__name__}: {e}", offset)
            return
        self.sent += 1
        self.statuses[case.operation.label, str(response.status_code)] += 1
        request = response.request
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except schemathesis.errors.FailureGroup:
            self._fail(case, request.headers.get("Content-Type", ""), request.body,
                       str(response.status_code), response.text, offset)
            return
        if "event-stream" in response.headers.get("content-type", [""])[0] and \
                STREAMED_SERVER_ERROR.search(response.text):
            # A stream's status is sent before generation starts: a server error mid-stream is
            # an event.
            self._fail(case, request.headers.get("Content-Type", ""), request.body,
                       f"{response.status_code} (stream)", response.text, offset)

    def _fail(self, case, content_type: str, body, status: str, text: str, offset: int) -> None:
        self.failures.append(Failure(case.method, case.path, content_type, _shown(body),
                                     _fields(case.path, case.body), status, text,
                                     _server_exception(self.server, offset, text)))

    def distinct(self) -> list[list[Failure]]:
        """The failures by kind (same operation, status and error), shortest bodies first."""
        kinds: dict[tuple, list[Failure]] = {}
        for failure in self.failures:
            kinds.setdefault(failure.key(), []).append(failure)
        return [sorted(group, key=lambda f: len(f.body)) for group in kinds.values()]


class _OutOfTime(Exception):
    """Ends a random phase at its deadline (drawing the cases it would skip takes time too)."""


def fuzz_randomly(fuzzer: Fuzzer, operation, mode: GenerationMode) -> None:
    """Up to RANDOM_EXAMPLES random cases of `operation` in `mode`, until the fuzzer's
    deadline. Hypothesis only draws them: the test body raises only to stop, and there is no
    shrinking and nothing stored in a database."""

    @hypothesis.settings(max_examples=RANDOM_EXAMPLES, deadline=None, database=None,
                         phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        if fuzzer.out_of_time():
            raise _OutOfTime
        fuzzer.send(case)

    try:
        run()
    except _OutOfTime:
        fuzzer.skipped += 1


def share(operation, mode: GenerationMode) -> int:
    """The random phase's time weight of `operation` in `mode` (see GENERATING_SHARE)."""
    generating = operation.path in GENERATING_PATHS
    return GENERATING_SHARE if generating and mode == GenerationMode.POSITIVE else 1


def test_fuzz_never_a_server_error(server):
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json",
                                           config=schemathesis.Config(), headers=AUTH,
                                           timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "GET /health", "GET /metrics", "GET /v1/models", "POST /tokenize", "POST /detokenize",
        "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/messages",
        "POST /v1/messages/count_tokens", "POST /v1/responses", "POST /v1/embeddings",
        "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}"}
    fuzzer = Fuzzer(server, FUZZ_BUDGET_S)
    start = time.monotonic()

    # Schemathesis' boundary cases: each field at its bounds and just past them, nulls, missing
    # fields, wrong types, other content types, other HTTP methods. Each operation gets an
    # equal share of BOUNDARY_SHARE of the budget (what a quick one leaves goes to the next).
    end = start + FUZZ_BUDGET_S * BOUNDARY_SHARE
    for i, operation in enumerate(operations):
        fuzzer.deadline = time.monotonic() + (end - time.monotonic()) / (len(operations) - i)
        generation = schema.config.generation_for(operation=operation, phase="coverage")
        for case in schema.iter_coverage_cases(operation, generation_config=generation,
                                               generation_modes=list(GenerationMode)):
            if fuzzer.out_of_time():
                break  # drawing the rest would take time too
            fuzzer.send(case)
    boundary, boundary_s = fuzzer.sent, time.monotonic() - start
    fuzzer.deadline = start + FUZZ_BUDGET_S

    # Random cases, valid and invalid (the schema states what the server checks, so most valid
    # ones reach the engine). Each operation and mode gets its share of the time left, the
    # quick ones first, so that what they leave goes to the generating ones.
    runs = sorted(((share(operation, mode), operation, mode) for operation in operations
                   for mode in (GenerationMode if operation.body else [GenerationMode.POSITIVE])),
                  key=lambda run: run[0])
    end = fuzzer.deadline
    for i, (weight, operation, mode) in enumerate(runs):
        left = sum(run[0] for run in runs[i:])
        fuzzer.deadline = time.monotonic() + (end - time.monotonic()) * weight / left
        fuzz_randomly(fuzzer, operation, mode)

    elapsed = time.monotonic() - start
    distinct = fuzzer.distinct()
    print(f"\napi fuzz: {fuzzer.sent} requests ({boundary} boundary in {boundary_s:.0f} s, "
          f"{fuzzer.sent - boundary} random) in {elapsed:.0f} s; random phases cut short by "
          f"the {FUZZ_BUDGET_S} s budget: {fuzzer.skipped}, {fuzzer.unencodable} unencodable; "
          f"{len(fuzzer.failures)} 5xx or dropped ({len(distinct)} distinct)")
    for slow in fuzzer.slow:
        print(f"  asked again after {REQUEST_TIMEOUT_S} s without an answer: {slow}")
    for label in sorted({label for label, _ in fuzzer.statuses}):
        answers = sorted((status, n) for (op, status), n in fuzzer.statuses.items() if op == label)
        print(f"  {label}: " + ", ".join(f"{n}x {status}" for status, n in answers))

    # Each kind with its three shortest bodies (one error message may have several causes).
    report = "\n".join(
        f"[{len(group)}x] {group[0]}" + "".join(
            f"\n    also: {f.fields or f.body[:300]}" for f in group[1:EXAMPLES_SHOWN])
        for group in distinct)
    # Whatever came before, the server still serves.
    try:
        after = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, timeout=60,
                           json={"prompt": "Hi", "max_tokens": 2})
        answer = f"{after.status_code} {after.text}"
    except httpx.HTTPError as e:
        answer = f"no answer: {type(e).__name__}: {e}"
    assert answer.startswith("200 "), (
        f"after the fuzz, a plain completion got {answer}\nthe fuzz's failures:\n{report}")
    assert not fuzzer.failures, (
        f"{len(fuzzer.failures)} of {fuzzer.sent} requests got a 5xx or no answer; "
        f"{len(distinct)} distinct:\n{report}")
    assert fuzzer.sent >= 100, "the fuzz sent too few requests to mean anything"


# Output constraints that end early, need particular tokens or allow only EOS, drawn with the
# fields that fight them (min_tokens bans stop tokens, stop ids and logit_bias take tokens away)
CONSTRAINTS = [{"regex": "ab"}, {"regex": "[0-9]{1,3}"}, {"guided_regex": ""},
               {"guided_choice": ["yes", "no"]}, {"response_format": {"type": "json_object"}},
               {"structured_outputs": {"json": {"type": "object", "required": ["a"],
                                                "properties": {"a": {"type": "integer"}}}}},
               {"ebnf": 'root ::= "x" [0-9]'}, {"regex": "x3øö7\U00036120¾"}]
# Tokens the constraints above are made of, EOS (2) and other specials
TOKENS = [0, 1, 2, 104, 369, 33, 34, 105]
COMBINATIONS = 100  # examples, a tenth of a second each
COMBINATION_MAX_TOKENS = 8


@pytest.mark.slow  # make test: the fuzz above
@hypothesis.settings(max_examples=COMBINATIONS, deadline=None, database=None,
                     phases=[Phase.generate], suppress_health_check=list(HealthCheck))
@hypothesis.given(constraint=st.sampled_from(CONSTRAINTS),
                  min_tokens=st.integers(0, COMBINATION_MAX_TOKENS - 1),
                  stop_token_ids=st.lists(st.sampled_from(TOKENS), max_size=2),
                  stop=st.lists(st.sampled_from(["a", "}", "1", "\n"]), max_size=2),
                  ignore_eos=st.booleans(),
                  logit_bias=st.dictionaries(st.sampled_from([str(t) for t in TOKENS]),
                                             st.sampled_from([-100, 100]), max_size=2),
                  n=st.integers(1, 2), skip_special_tokens=st.booleans(),
                  temperature=st.sampled_from([0, 1]), stream=st.booleans())
def test_constraints_with_min_tokens_and_stops_are_200_or_named_400(server, constraint, stream,
                                                                     min_tokens, n, **fields):
    """Every combination of an output constraint with `min_tokens`, stop tokens and strings,
    `ignore_eos`, `logit_bias`, `n` and `skip_special_tokens` is answered 200 with at least
    `min_tokens` tokens per completion, or 400 (whole or streamed) saying why; never a 5xx
    (the API fuzz found a 500, and a grammar complete before min_tokens answered "stop")."""
    body = {"prompt": "Ø/´", "max_tokens": COMBINATION_MAX_TOKENS, "min_tokens": min_tokens,
            "n": n, "stream": stream, **constraint, **fields}
    response = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, json=body,
                          timeout=REQUEST_TIMEOUT_S)
    if response.status_code == 400:
        assert response.json()["error"]["type"] == "invalid_request_error", response.text
        return
    assert response.status_code == 200, f"{body}: {response.status_code} {response.text}"
    if not stream:
        usage = response.json()["usage"]
        assert usage["completion_tokens"] >= n * min_tokens, f"{body}: {response.text}"
        return
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    errors = [event["error"] for event in events if "error" in event]
    assert all(e["type"] == "invalid_request_error" for e in errors), f"{body}: {errors}"


@pytest.mark.slow
def test_schemathesis_cli_finds_no_server_error(tmp_path):
    """schemathesis' own CLI as an outside user runs it (the issue's run: seed 7, 40 examples
    per operation, its examples, coverage and fuzzing phases, 420 s, one worker) against
    `braid serve --tp 2 --max-total-tokens 16384` (eager): no 5xx, no "schema validation
    mismatch" warning (the schema states what the server checks), and each timeout a long
    generation, which the server's log shows cut short with its tokens coming."""
    from server_utils import braid_server

    cli = Path(sys.executable).parent / "schemathesis"
    with braid_server("--tp", "2", "--max-total-tokens", "16384", "--log-level", "info",
                      log_dir=tmp_path) as server:
        run = subprocess.run(
            [str(cli), "run", f"{server.base_url}/openapi.json", "--checks",
             "not_a_server_error", "--phases", "examples,coverage,fuzzing", "-n", "40",
             "--seed", "7", "-w", "1", "--max-time", "420", "--request-timeout", "60",
             "--report", "ndjson", "--report-dir", str(tmp_path), "--no-color"],
            capture_output=True, text=True, timeout=900)
        time.sleep(1)  # the last abandoned request's log line
        log = server.output()
    answers, timeouts = Counter(), 0
    for line in next(tmp_path.glob("*.ndjson")).read_text().splitlines():
        scenario = json.loads(line).get("ScenarioFinished", {}).get("recorder") or {}
        for interaction in scenario.get("interactions", {}).values():
            response = interaction.get("response")
            if response is None:
                timeouts += 1
            else:
                answers[response["status_code"]] += 1
    # "<id>: the client went away after S s, with T of at most M tokens generated"
    abandoned = [(float(s), int(t), int(m)) for s, t, m in re.findall(
        r"went away after ([\d.]+) s, with (\d+) of at most (\d+) tokens", log)]
    print(f"\nschemathesis: answers {dict(answers)}, {timeouts} timeouts; abandoned "
          f"generations (s, tokens, asked): {sorted(abandoned)[-5:]}")
    assert not [status for status in answers if status >= 500], run.stdout[-5000:]
    assert "Schema validation mismatch" not in run.stdout, run.stdout[-5000:]
    assert timeouts <= sum(1 for _, tokens, _ in abandoned if tokens > 0), (
        f"a timeout that is not a generation in progress:\n{run.stdout[-5000:]}")
    assert sum(answers.values()) >= 500, run.stdout[-5000:]
