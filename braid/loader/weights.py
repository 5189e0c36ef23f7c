"""Lazy checkpoint tensors and the generic name-matching weight loading loop."""

from __future__ import annotations

import os
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


def with_progress(items: Iterable[T], desc: str, delay_s: float) -> Iterable[T]:
    """`items`, with a tqdm bar on stderr when it is a terminal and the loop lasts `delay_s`.

    The bar gets a thread lock: tqdm's default multiprocessing lock is a semaphore that rank
    processes, which end with `os._exit`, would leak.
    """
    if not sys.stderr.isatty():
        return items
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    return tqdm(items, desc=desc, unit="tensor", file=sys.stderr, delay=delay_s, leave=False)


def read_into(path: str | os.PathLike, offset: int, out: torch.Tensor, what: str) -> torch.Tensor:
    """`out` (contiguous) filled with the bytes of file `path` from `offset` on, by plain reads:
    pages a rank touched through a map of the file would stay counted in its memory beside its
    copy of them until the map closed. `ValueError` naming `what` where the file ends first."""
    buffer = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else b""
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(buffer):
            read = os.preadv(fd, [buffer[done:]], offset + done)
            if read == 0:
                raise ValueError(f"{path}: {what} is cut short")
            done += read
    finally:
        os.close(fd)
    return out


class LazyWeight(ABC):
    """A checkpoint tensor read on demand, so each rank materialises only its own slice.

    A tensor in llama.cpp's quantized blocks that braid computes from (`ggml_weight`) has its
    GGML type in `ggml_type` and gives its bytes through `narrow_blocks`; `narrow` dequantizes."""

    shape: tuple[int, ...]
    ggml_type: int | None = None

    @abstractmethod
    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) `[start, start + length)` as a tensor."""

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        return self.narrow(0, 0, self.shape[0])

    def block_rows(self, start: int, length: int) -> torch.Tensor:
        """Rows `[start, start + length)` of a tensor with a `ggml_type`, as their blocks'
        bytes (uint8 `[length, bytes per row]`)."""
        raise NotImplementedError(f"{type(self).__name__} has no quantized blocks")

    def narrow_blocks(self, dim: int, start: int, length: int) -> torch.Tensor:
        """`narrow` as blocks' bytes: rows, or columns on whole blocks (`ValueError` where the
        range cuts one)."""
        if dim == 0:
            return self.block_rows(start, length)
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        elements, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        if start % elements or length % elements:
            raise ValueError(f"columns [{start}, {start + length}) cut the "
                             f"{GGMLQuantizationType(self.ggml_type).name} blocks of "
                             f"{elements} columns")
        rows = self.block_rows(0, self.shape[0])
        # a copy: a view would keep every rank's columns alive
        return rows[:, start // elements * nbytes:(start + length) // elements * nbytes].clone(
            memory_format=torch.contiguous_format)


class TensorWeight(LazyWeight):
    """An already materialised tensor behind the lazy interface (tests, converted weights)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)


class RowSlice(LazyWeight):
    """Rows `[offset, offset + rows)` of another lazy tensor: one part of a tensor a checkpoint
    fused (Phi-3's `qkv_proj`), read only as far as a rank's slice of it."""

    def __init__(self, base: LazyWeight, offset: int, rows: int) -> None:
        self.base, self.offset = base, offset
        self.shape = (rows, *base.shape[1:])
        self.ggml_type = base.ggml_type

    def block_rows(self, start: int, length: int) -> torch.Tensor:
        return self.base.block_rows(self.offset + start, length)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self.base.narrow(0, self.offset + start, length)
        return self.base.narrow(0, self.offset, self.shape[0]).narrow(dim, start, length)


# (our parameter segment, checkpoint segment, shard id): checkpoint tensors fused into one param.
StackedMapping = Sequence[tuple[str, str, object]]


def _rename(name: str, stacked: StackedMapping) -> tuple[str, object]:
    """Map a checkpoint name to (parameter name, shard id) by exact dotted segments."""
    segments = name.split(".")
    for param_segment, ckpt_segment, shard_id in stacked:
        if ckpt_segment in segments:
            i = segments.index(ckpt_segment)
            return ".".join([*segments[:i], param_segment, *segments[i + 1:]]), shard_id
    return name, None


def load_weights(model: nn.Module, weights: Iterable[tuple[str, LazyWeight]]) -> None:
    """Copy checkpoint tensors into `model`'s parameters through their `weight_loader`s.

    The model says how names map: `checkpoint_parts(name, weight)` (a fused checkpoint tensor
    as its parts, each under its own name), `stacked_params` (checkpoint tensors fused into
    one parameter), `is_ignored_weight(name)` (present but unused: a tied `lm_head.weight`,
    extra layers), and `checkpoint_param(name)` returning (parameter name, shard id), or None
    for the stacked rule. A parameter fed by several shards lists them in `shard_ids`
    unless the stacked rule implies them. Raises `ValueError` naming every missing and every
    unexpected weight.
    """
    params = dict(model.named_parameters())
    stacked: StackedMapping = model.stacked_params
    loaded: set[tuple[str, object]] = set()
    unexpected = []
    parts = ((name, part) for fused, weight in weights
             for name, part in model.checkpoint_parts(fused, weight))
    for ckpt_name, weight in parts:
        if ckpt_name.endswith("rotary_emb.inv_freq") or model.is_ignored_weight(ckpt_name):
            continue
        name, shard_id = model.checkpoint_param(ckpt_name) or _rename(ckpt_name, stacked)
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        try:
            param.weight_loader(param, weight, shard_id)
        except ValueError as e:
            raise ValueError(f"{ckpt_name}: {e}") from e
        loaded.add((name, shard_id))
    expected = set()
    for name, param in params.items():
        shard_ids = (getattr(param, "shard_ids", None)
                     or [s for p, _, s in stacked if p in name.split(".")] or [None])
        expected.update((name, s) for s in shard_ids)
    missing = sorted(f"{n}" + (f" [{s}]" if s is not None else "") for n, s in expected - loaded)
    problems = []
    if missing:
        problems.append(f"missing weights: {', '.join(missing[:10])}"
                        + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
    if unexpected:
        problems.append(f"unexpected weights: {', '.join(sorted(unexpected)[:10])}"
                        + (f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else ""))
    if problems:
        raise ValueError("checkpoint does not match the model: " + "; ".join(problems))
