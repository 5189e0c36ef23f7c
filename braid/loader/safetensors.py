"""Hugging Face safetensors folders (single file or sharded with an index), read lazily.

A rank reads the bytes of its slices into tensors of its own (`read_into`) rather than through
a map of the file: pages it touched in a map would stay mapped, counted in its memory beside
its copy of them, until the map closed (a tp 2 launch of a 2.5 GB bf16 folder peaked 2.7 GB
higher that way).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from math import prod
from pathlib import Path

import torch

from braid.loader.weights import LazyWeight, read_into

# safetensors' dtype names
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_header(file: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where its data
    starts."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


class SafetensorsWeight(LazyWeight):
    """One tensor of a safetensors file; a slice of rows reads only those rows' bytes."""

    def __init__(self, file: Path, name: str, entry: dict, data_start: int) -> None:
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {entry['dtype']}, which braid "
                             f"does not read (it reads {', '.join(DTYPES)})")
        self._file, self._name = file, name
        self._dtype = DTYPES[entry["dtype"]]
        self.shape = tuple(entry["shape"])
        self._offset = data_start + entry["data_offsets"][0]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._rows(start, length)
        rows = self._rows(0, self.shape[0]).narrow(dim, start, length)
        return rows.clone(memory_format=torch.contiguous_format)  # frees the other columns

    def _rows(self, start: int, length: int) -> torch.Tensor:
        inner = self.shape[1:]
        row_bytes = prod(inner) * self._dtype.itemsize
        return read_into(self._file, self._offset + start * row_bytes,
                         torch.empty(length, *inner, dtype=self._dtype), f"tensor {self._name}")


def iterate_safetensors(folder: str) -> Iterator[tuple[str, LazyWeight]]:
    """(name, lazy tensor) for every tensor in every `*.safetensors` file of `folder`."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for file in files:
        header, data_start = read_header(file)
        for name, entry in header.items():
            yield name, SafetensorsWeight(file, name, entry, data_start)
