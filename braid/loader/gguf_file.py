"""A GGUF file's metadata and tensor index, read with `struct` from a memory map.

The `gguf` package's `GGUFReader` makes numpy views of every item of every metadata array as
it parses, so a vocabulary of 49k tokens and as many merges took four seconds on a 2-core host:
paid by the engine and by every rank at every launch. This reader walks the same header in a
small fraction of that and gives the values as Python objects (what `ReaderField.contents()`
gives, except that an array of arrays stays nested) and each tensor's bytes as the same numpy
view of the map as `GGUFReader` does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from braid.errors import UserError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
# struct codes of the scalar value types (read little-endian, as llama.cpp writes its files)
_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
# numpy item types of the tensor types stored as plain arrays (any other is bytes of blocks)
_PLAIN_TENSORS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file. `shape` is GGUF's (innermost dimension first); `data` is its
    bytes in the map as `GGUFReader` shapes them: an array of the type in PyTorch order for
    plain types, rows of bytes (`quant_shape_to_byte_shape`) for block formats."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    """Reads little-endian values from `buffer` one after the other."""

    def __init__(self, buffer, path: str) -> None:
        self.buffer, self.offset, self.path = buffer, 0, path

    def values(self, code: str, count: int) -> list:
        """The next `count` values of struct code `code`."""
        fmt = f"<{count}{code}"
        try:
            values = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error:
            raise UserError(f"{self.path}: the GGUF header ends before its last value") from None
        self.offset += struct.calcsize(fmt)
        return list(values)

    def unpack(self, code: str):
        return self.values(code, 1)[0]

    def string(self) -> str:
        length = self.unpack("Q")
        start, self.offset = self.offset, self.offset + length
        if self.offset > len(self.buffer):
            raise UserError(f"{self.path}: the GGUF header ends inside a string")
        try:
            return bytes(self.buffer[start:self.offset]).decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{self.path}: the string at byte {start} is not UTF-8") from None

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item_kind, count = self.unpack("I"), self.unpack("Q")
            code = _SCALARS.get(item_kind)
            if code is None:  # strings and nested arrays: one by one
                return [self.value(item_kind) for _ in range(count)]
            return self.values(code, count)
        code = _SCALARS.get(kind)
        if code is None:
            raise UserError(f"{self.path}: GGUF value type {kind} is not one the format has")
        return self.unpack(code)


class GGUFFileIndex:
    """The metadata (`fields`: key -> value) and tensors (`tensors`, in file order) of the GGUF
    file at `path`; the tensors' data stay in the file's read-only map until read."""

    def __init__(self, path: str | Path) -> None:
        path = str(path)
        self.map = np.memmap(path, mode="r")
        cursor = _Cursor(memoryview(self.map), path)
        if bytes(self.map[:4]) != MAGIC:
            raise UserError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        cursor.offset = 4
        version = cursor.unpack("I")
        if version not in (2, 3):
            raise UserError(f"{path}: GGUF version {version} is not supported (2 and 3 are; a "
                            "big-endian file reads as another version)")
        tensor_count, field_count = cursor.unpack("Q"), cursor.unpack("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = cursor.string()
            self.fields[key] = cursor.value(cursor.unpack("I"))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = tuple(cursor.unpack("Q") for _ in range(cursor.unpack("I")))
            infos.append((name, dims, GGMLQuantizationType(cursor.unpack("I")),
                          cursor.unpack("Q")))
        alignment = int(self.fields.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT))
        data_start = -(-cursor.offset // alignment) * alignment
        self.tensors = [self._tensor(path, data_start, *info) for info in infos]

    def _tensor(self, path: str, data_start: int, name: str, dims: tuple[int, ...],
                kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
        elements = int(np.prod(dims, dtype=np.int64))
        block_size, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = elements * type_size // block_size
        start = data_start + offset
        if start + n_bytes > len(self.map):
            raise UserError(f"{path}: tensor {name} ends past the end of the file (truncated?)")
        shape = tuple(reversed(dims))
        item = _PLAIN_TENSORS.get(kind)
        if item is None:
            item, shape = np.uint8, quant_shape_to_byte_shape(shape, kind)
        data = self.map[start:start + n_bytes].view(item).reshape(shape)
        return GGUFTensor(name, kind, dims, n_bytes, start, data)
