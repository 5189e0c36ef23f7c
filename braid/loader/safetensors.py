"""Hugging Face safetensors folders (single file or sharded with an index), read lazily."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from braid.loader.weights import LazyWeight


class SafetensorsWeight(LazyWeight):
    """One tensor of a safetensors file; slices are read without loading the rest."""

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def iterate_safetensors(folder: str) -> Iterator[tuple[str, LazyWeight]]:
    """(name, lazy tensor) for every tensor in every `*.safetensors` file of `folder`."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, SafetensorsWeight(handle, name)
