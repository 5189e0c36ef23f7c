"""`POST /v1/embeddings` (OpenAI's shape): each input's final hidden states pooled by the
engine (`SamplingParams.pooling`), normalised to unit length, shortened to `dimensions` where
the model was trained for it (Matryoshka), as floats or base64 of little-endian float32."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, create_model

from braid.server.generation import PromptRun
from braid.server.protocol import NonEmptyStr, RequestBody, RequestLimits

POOLINGS = ("auto", "last", "mean")


def checkpoint_pooling(model_path: str) -> str:
    """The pooling a checkpoint folder declares (sentence-transformers' `1_Pooling/config.json`:
    mean or last token), else the last token's: what decoder embedding models use."""
    config = Path(model_path) / "1_Pooling" / "config.json"
    if config.is_file():
        modes = json.loads(config.read_text())
        if modes.get("pooling_mode_mean_tokens"):
            return "mean"
    return "last"


def matryoshka_dimensions(model_path: str) -> list[int] | bool:
    """The shorter lengths a checkpoint's vectors keep their meaning at (its config's
    `matryoshka_dimensions`; True: any, `is_matryoshka`; False: none)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    fields = json.loads(config.read_text())
    return fields.get("matryoshka_dimensions") or bool(fields.get("is_matryoshka"))


class EmbeddingRequest(RequestBody):
    """`POST /v1/embeddings`."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


def bounded_model(limits: RequestLimits, vocab_size: int, max_context: int,
                  served_model: str) -> type[EmbeddingRequest]:
    """The request model with the server's limits and the model's vocabulary and context in
    its fields and schema (as `protocol.bounded_models` makes the others)."""
    token = Annotated[int, Field(ge=0, lt=vocab_size)]
    ids = Annotated[list[token], Field(min_length=1, max_length=max_context)]
    many = Field(min_length=1, max_length=limits.max_sequences_per_request)
    model = create_model(
        "EmbeddingRequest", __base__=EmbeddingRequest,
        input=(NonEmptyStr | Annotated[list[NonEmptyStr], many] | ids
               | Annotated[list[ids], many], ...))
    model.served_model = served_model
    return model


class EmbeddingResponder:
    """The response of a finished embedding request."""

    def __init__(self, model_name: str, body: EmbeddingRequest, runs: list[PromptRun]) -> None:
        self.model_name, self.request, self.runs = model_name, body, runs

    def vector(self, run: PromptRun) -> list[float] | str:
        vector = run.completions[0].embedding
        if self.request.dimensions is not None:
            vector = vector[:self.request.dimensions]
        vector = (vector / np.linalg.norm(vector)).astype(np.float32)
        if self.request.encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode()
        return vector.tolist()

    def response(self) -> dict:
        tokens = sum(len(run.prompt_ids) for run in self.runs)
        return {"object": "list", "model": self.model_name,
                "data": [{"object": "embedding", "index": i, "embedding": self.vector(run)}
                         for i, run in enumerate(self.runs)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
