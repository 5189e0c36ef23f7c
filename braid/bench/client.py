"""What a client of an OpenAI-compatible server needs to find its way: the key it sends, the
model the server serves, and that model's tokenizer read locally. Shared by the serving
benchmark (`braid.bench.serving`) and the MMLU evaluation against a server
(`braid.eval.mmlu`)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from braid.errors import UserError


def auth_headers() -> dict[str, str]:
    """The bearer key from OPENAI_API_KEY (or API_KEY), as SGLang's benchmark sends it."""
    key = os.environ.get("OPENAI_API_KEY") or os.environ.get("API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def discover_model(client: httpx.Client, base_url: str) -> tuple[str, str | None]:
    """The server's first model from `GET /v1/models`, and its local path if it gives one."""
    try:
        response = client.get(f"{base_url}/v1/models", headers=auth_headers())
        response.raise_for_status()
        entry = response.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise UserError(f"could not list the models of {base_url} ({e}); pass --model") from None
    root = entry.get("root")
    return entry["id"], root if root and Path(root).exists() else None


def load_bench_tokenizer(path: str | None):
    """The tokenizer of the served model, from a local path (never downloaded)."""
    from braid.loader.tokenizer import load_tokenizer

    if path is None:
        raise UserError("the server does not say where its model is: pass --tokenizer, a local "
                        "GGUF file or model folder")
    if not Path(path).exists():
        raise UserError(f"--tokenizer {path} does not exist (tokenizers are never downloaded)")
    return load_tokenizer(path)
