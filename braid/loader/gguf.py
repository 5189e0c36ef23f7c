"""GGUF files (llama.cpp's format) through the `gguf` package.

Tensors are dequantized lazily and per slice of rows; llama.cpp's rotary permutation of the Q and K
projections is undone so weights match the Hugging Face layout; the config comes from metadata.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from braid.config import ModelConfig, UserError
from braid.loader.weights import LazyWeight

# GGUF architecture name -> Hugging Face architecture braid serves it as.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


@lru_cache(maxsize=4)
def _reader(path: str) -> GGUFReader:
    return GGUFReader(path)


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(path: str) -> ModelConfig:
    """ModelConfig from GGUF metadata; `UserError` for an architecture braid does not serve."""
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = None
    if get("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=SUPPORTED_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=int(num_heads),
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=rope_scaling,
        eos_token_ids=() if eos is None else (int(eos),),
    )


def unpermute_rotary(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: per head, interleaved rotary halves back to two blocks."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


class GGUFWeight(LazyWeight):
    """One GGUF tensor; a slice of rows dequantizes only those rows (quant blocks run along rows).

    `head_dim` is set for Q and K projections: their rows are unpermuted head by head after
    slicing, so a slice must start and end on head boundaries.
    """

    def __init__(self, tensor, head_dim: int | None = None) -> None:
        self._tensor = tensor
        self._head_dim = head_dim
        self.shape = tuple(int(d) for d in reversed(tensor.shape))

    def _rows(self, start: int, length: int) -> torch.Tensor:
        data = self._tensor.data
        qtype = self._tensor.tensor_type
        if len(self.shape) == 1:
            values = np.asarray(data[start:start + length], dtype=np.float32)
        elif qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = np.asarray(data[start:start + length], dtype=np.float32)
        else:
            values = dequantize(data[start:start + length], qtype)
        if not values.flags.writeable:  # a slice of the read-only memory map
            values = values.copy()
        return torch.from_numpy(np.ascontiguousarray(values).reshape(length, *self.shape[1:]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            rows = self._rows(start, length)
            if self._head_dim is not None:
                if start % self._head_dim or length % self._head_dim:
                    raise ValueError("rotary projections are sliced on head boundaries only")
                rows = unpermute_rotary(rows, length // self._head_dim)
            return rows
        return self._rows(0, self.shape[0]).narrow(dim, start, length)


def hf_name(gguf_name: str) -> str:
    """Hugging Face name of a llama GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3...`)."""
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    match = _GLOBAL_RE.match(gguf_name)
    if match and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    return gguf_name  # reported as unexpected by the loader


def iterate_gguf(path: str, config: ModelConfig) -> Iterator[tuple[str, LazyWeight]]:
    """(Hugging Face name, lazy tensor) for every tensor of a llama GGUF file."""
    for tensor in _reader(path).tensors:
        name = hf_name(tensor.name)
        head_dim = config.head_dim if name.endswith(("q_proj.weight", "k_proj.weight")) else None
        yield name, GGUFWeight(tensor, head_dim)
