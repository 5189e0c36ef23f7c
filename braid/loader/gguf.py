"""GGUF files (llama.cpp's format): read by `braid.loader.gguf_file`, dequantized by the `gguf`
package.

`gguf_config` turns a file's metadata into the Hugging Face `config.json` dict of its family;
`iterate_gguf` yields its tensors under Hugging Face names with what llama.cpp's converter did
undone (`braid.loader.gguf_families` and each family's `GGUFMapping` say what): the rotary
permutation of Q and K, Gemma's `+1` on norms, experts stacked into one 3-D tensor per
projection (each expert is a view of its own). Tensors are dequantized lazily and per slice of
rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType, Keys, TokenType
from gguf.quants import dequantize

from braid.loader.gguf_families import config_dict, expert_name, family_of, tensor_names
from braid.loader.gguf_file import GGUFFileIndex
from braid.loader.model_config import ModelConfig
from braid.loader.weights import LazyWeight, read_into

if TYPE_CHECKING:  # the model code's package, which the API process must not load
    from braid.models.spec import Architecture

_NAME_RE = re.compile(r"^(.+)\.(weight|bias)$")
# The formats braid's operators compute from as they are (`braid.layers.ggml_weight`)
BLOCK_TYPES = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
               GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
               GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}


@lru_cache(maxsize=4)
def _reader(path: str) -> GGUFFileIndex:
    return GGUFFileIndex(path)


def _metadata(reader: GGUFFileIndex, path: str) -> tuple[Architecture, Callable]:
    """The architecture that serves the file (its family's spec) and a reader of its metadata
    by `gguf.Keys` template."""
    arch = reader.fields.get(Keys.General.ARCHITECTURE)

    def get(key: str, default=None):
        return reader.fields.get(key.format(arch=arch), default)

    return family_of(arch, get, path), get


def _shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch order (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def gguf_config(path: str) -> dict:
    """The Hugging Face `config.json` dict of a GGUF file, from its metadata (what
    `ModelConfig.from_hf_dict` reads); `UserError` for an architecture braid does not serve."""
    reader = _reader(path)
    architecture, get = _metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}

    def values(name: str) -> list[float]:
        return np.asarray(tensors[name].data, dtype=np.float32).tolist()

    return config_dict(architecture, get, {name: _shape(t) for name, t in tensors.items()}, values)


def gguf_control_tokens(path: str) -> dict[int, tuple[str, bool]]:
    """The file's control and user-defined tokens: id -> (text, whether it is special, i.e. a
    control token), as the tokenizer must keep them: whole, at their ids."""
    fields = _reader(path).fields
    tokens = fields.get(Keys.Tokenizer.LIST)
    kinds = fields.get(Keys.Tokenizer.TOKEN_TYPE)
    if tokens is None or kinds is None:
        return {}
    return {i: (token, kind == TokenType.CONTROL)
            for i, (token, kind) in enumerate(zip(tokens, kinds))
            if kind in (TokenType.CONTROL, TokenType.USER_DEFINED)}


def gguf_pre_tokenizer(path: str) -> str | None:
    """The file's `tokenizer.ggml.pre`: llama.cpp's name for how text is split before BPE."""
    return _reader(path).fields.get(Keys.Tokenizer.PRE)


def unpermute_rotary(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: per head, interleaved rotary halves back to two blocks."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


class GGUFWeight(LazyWeight):
    """One GGUF tensor, or one expert of a stacked 3-D one; a slice of rows dequantizes only
    those rows (quant blocks run along rows).

    `head_dim` is set for permuted Q and K projections: their rows are unpermuted head by head
    after slicing, so a slice must start and end on head boundaries. `offset` is subtracted
    from every value (what the converter added to Gemma's norms). With `keep_blocks`, a 2-D
    tensor in a format braid computes from has its `ggml_type` (`block_rows` reads its bytes
    from the file at `path`).
    """

    def __init__(self, tensor, head_dim: int | None = None, expert: int | None = None,
                 offset: float = 0.0, keep_blocks: bool = False, path: str = "") -> None:
        self._tensor = tensor
        self._path = path
        self._head_dim = head_dim
        self._expert = expert
        self._offset = offset
        shape = _shape(tensor)
        self.shape = shape if expert is None else shape[1:]
        kind = int(tensor.tensor_type)
        if keep_blocks and len(self.shape) == 2 and kind in BLOCK_TYPES and not offset:
            self.ggml_type = kind

    def block_rows(self, start: int, length: int) -> torch.Tensor:
        """Read from the file, not through the reader's map: pages a rank touched in the map
        would count in its memory beside its copy of them until the map closes."""
        if self.ggml_type is None:
            return super().block_rows(start, length)
        row_bytes = self._tensor.data.shape[-1]
        rows = read_into(self._path, self._tensor.data_offset + start * row_bytes,
                         torch.empty(length, row_bytes, dtype=torch.uint8),
                         f"tensor {self._tensor.name}")
        return self._unpermuted(rows, start, length)

    def _unpermuted(self, rows: torch.Tensor, start: int, length: int) -> torch.Tensor:
        if self._head_dim is None:
            return rows
        if start % self._head_dim or length % self._head_dim:
            raise ValueError("rotary projections are sliced on head boundaries only")
        return unpermute_rotary(rows, length // self._head_dim)

    def _rows(self, start: int, length: int) -> torch.Tensor:
        data = self._tensor.data
        if self._expert is not None:
            data = data[self._expert]
        qtype = self._tensor.tensor_type
        if len(self.shape) == 1 or qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = np.asarray(data[start:start + length], dtype=np.float32)
        else:
            values = dequantize(data[start:start + length], qtype)
        if self._offset:
            values = values - np.float32(self._offset)
        if not values.flags.writeable:  # a slice of the read-only memory map
            values = values.copy()
        return torch.from_numpy(np.ascontiguousarray(values).reshape(length, *self.shape[1:]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._unpermuted(self._rows(start, length), start, length)
        return self.narrow(0, 0, self.shape[0]).narrow(dim, start, length)


def iterate_gguf(path: str, config: ModelConfig, keep_blocks: bool = False
                 ) -> Iterator[tuple[str, LazyWeight]]:
    """(Hugging Face name, lazy tensor) for every weight of a GGUF file; with `keep_blocks`
    the quantized tensors braid computes from give their blocks (`GGUFWeight`).

    A tensor the family's naming does not cover keeps its GGUF name, which the weight loader
    reports as unexpected.
    """
    # A reader of its own, whose metadata goes once the mapping is known: its fields hold the
    # vocabulary, which a rank would otherwise keep while it loads.
    reader = GGUFFileIndex(path)
    mapping = _metadata(reader, path)[0].gguf
    reader.fields.clear()
    names = tensor_names(mapping, config.num_layers)
    for tensor in reader.tensors:
        if tensor.name in mapping.config_tensors:  # part of the config
            continue
        match = _NAME_RE.match(tensor.name)
        base = names.get(match.group(1)) if match else None
        if base is None:
            yield tensor.name, GGUFWeight(tensor)
            continue
        name = f"{base}.{match.group(2)}"
        offset = mapping.norm_offset if name.endswith("norm.weight") else 0.0
        permuted = mapping.rotary_permuted and base.endswith((".q_proj", ".k_proj"))
        head_dim = config.head_dim if permuted else None
        if ".experts." in base:
            for expert in range(_shape(tensor)[0]):
                yield (f"{expert_name(base, expert)}.{match.group(2)}",
                       GGUFWeight(tensor, head_dim, expert, offset))
        else:
            yield name, GGUFWeight(tensor, head_dim, offset=offset, keep_blocks=keep_blocks,
                                   path=path)
