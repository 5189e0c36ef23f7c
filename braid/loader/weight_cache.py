"""A GGUF file's weights, dequantised once into a safetensors file in braid's cache.

Parsing a GGUF file and dequantising its tensors takes every rank seconds at every launch; the
cache entry (Hugging Face names, rotary permutation undone, in the engine's dtype) is mapped
instead, each rank reading only its slices. The driver builds the entry before it starts the
ranks; ranks only look it up, and read the GGUF file when it is absent (`--no-cache`, or a
torchrun rank on another host).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from math import prod
from pathlib import Path

import torch

from braid.cache import cached, find_entry
from braid.loader.model_config import ModelConfig
from braid.loader.weights import LazyWeight, with_progress

WEIGHTS_FILE = "model.safetensors"
_KIND = "weights"
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _variant(dtype: torch.dtype) -> str:
    return _SAFETENSORS_DTYPES[dtype].lower()


def write_safetensors(file: Path, weights: list[tuple[str, LazyWeight]],
                      dtype: torch.dtype) -> None:
    """Write `weights` as one safetensors file, one tensor in memory at a time."""
    header, offset = {}, 0
    for name, weight in weights:
        nbytes = prod(weight.shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(weight.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, weight in with_progress(weights, "converting weights (cached for later "
                                          "launches)", delay_s=1.0):
            tensor = weight.load().to(dtype).contiguous()
            if tuple(tensor.shape) != weight.shape:
                raise ValueError(f"{name}: read {tuple(tensor.shape)}, header says "
                                 f"{weight.shape}")
            f.write(tensor.view(torch.uint8).numpy().data)


def prepare_gguf_weights(path: str, config: ModelConfig, dtype: torch.dtype) -> None:
    """Build the cache entry of `path`'s weights in `dtype` unless it exists (driver side)."""
    from braid.loader.gguf import iterate_gguf

    def build(folder: Path) -> None:
        write_safetensors(folder / WEIGHTS_FILE, list(iterate_gguf(path, config)), dtype)

    def check(folder: Path) -> None:  # a damaged header fails here, not in the ranks
        from safetensors import safe_open

        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as handle:
            handle.keys()

    cached(path, _KIND, build, check, _variant(dtype))


def cached_gguf_weights(path: str, dtype: torch.dtype
                        ) -> Iterator[tuple[str, LazyWeight]] | None:
    """Lazy weights from the cache entry of `path` in `dtype`, or None when there is none."""
    folder = find_entry(path, _KIND, _variant(dtype))
    if folder is None:
        return None
    from braid.loader.safetensors import iterate_safetensors

    return iterate_safetensors(str(folder))
