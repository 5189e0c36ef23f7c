"""What a rank's model holds in memory: its weights in every form they are kept in, and its KV
cache, counted by the bytes of their storages (each once, however many views share it)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
from torch import nn

from braid.layers.quant import Quantizable
from braid.platform import release_free_memory

T = TypeVar("T")
# Checkpoint tensors loaded between two trims of the heap (`trimming`)
TRIM_EVERY = 32

_CACHE_ATTRIBUTES = ("k_cache", "v_cache", "k_scales", "v_scales", "cache")


def _bytes(tensors: list[torch.Tensor]) -> int:
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights: parameters (a dense weight kept only as GGML blocks holds none),
    GGML blocks, and oneDNN's packed copies (the size of the weight they pack)."""
    tensors = list(model.parameters())
    packed = 0
    for layer in model.modules():
        ggml = getattr(layer, "ggml", None)
        if ggml is not None:
            tensors += ggml.blocks
        if isinstance(layer, Quantizable) and (layer.packed is not None
                                               or layer.packed_halves is not None):
            weight = layer.quantizable_weight()
            packed += weight.numel() * weight.element_size()
    return _bytes(tensors) + packed


def kv_cache_bytes(model: nn.Module) -> int:
    """Bytes of the KV cache of every attention layer."""
    tensors = [getattr(layer, name) for layer in model.attention_layers()
               for name in _CACHE_ATTRIBUTES if getattr(layer, name, None) is not None]
    return _bytes([t for t in tensors if isinstance(t, torch.Tensor)])


def trimming(weights: Iterable[T]) -> Iterator[T]:
    """`weights`, the heap trimmed every TRIM_EVERY of them: a rank's slices are read into
    buffers that loading frees again, and freed heap pages otherwise stay counted until the
    end of loading (a quarter of a GiB at its peak for a 1.3 GB file)."""
    for i, weight in enumerate(weights):
        if i and i % TRIM_EVERY == 0:
            release_free_memory()
        yield weight
