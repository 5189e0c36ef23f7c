"""braid: a tensor-parallel LLM inference engine that overlaps communication with computation.

`from braid import LLM, SamplingParams` is the offline API. The names are loaded on first use,
so that importing a part of braid (the server's API process, say) loads only that part.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "braid.frontend.llm",
    "RequestOutput": "braid.frontend.tracker",
    "SamplingParams": "braid.engine.request",
    "StructuredOutputs": "braid.engine.grammar",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'braid' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
