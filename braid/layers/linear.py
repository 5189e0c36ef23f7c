"""Linear layers for tensor parallelism.

Each parameter carries a `weight_loader(param, weight, shard_id=None)` that copies its own slice
out of a lazy checkpoint tensor, so a rank materialises only what it keeps; a slice of a
tensor in quantized blocks is kept as its blocks (`load_rows`, `braid.layers.ggml_weight`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from braid.distributed.comm import Communicator, Pending
from braid.layers.ggml_weight import file_blocks
from braid.layers.partition import HeadShard, split_range
from braid.layers.quant import Quantizable
from braid.loader.weights import LazyWeight


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


def load_rows(param: nn.Parameter, row: int, weight: LazyWeight, dim: int, start: int,
              length: int, what: str, blocks: bool = True) -> None:
    """`param`'s rows from `row` on := `weight.narrow(dim, start, length)`: kept as quantized
    blocks where `weight` has them and `blocks` (the layer computes from them), else copied."""
    shape = list(weight.shape)
    shape[dim] = length
    dst = param.data.narrow(0, row, shape[0])
    if not (blocks and weight.ggml_type is not None):
        _copy_checked(dst, weight.narrow(dim, start, length), what)
        return
    if tuple(dst.shape) != tuple(shape):
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(shape)}")
    file_blocks(param, row, weight.ggml_type, weight.narrow_blocks(dim, start, length))


class ReplicatedLinear(nn.Module, Quantizable):
    """Full weight on every rank; every rank computes the same output."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.weight.weight_loader = self.load_weight
        self.bias = None
        if bias:
            self.bias = _param(out_features, dtype=dtype)
            self.bias.weight_loader = self.load_full

    def load_weight(self, param: nn.Parameter, weight: LazyWeight, shard_id: object = None
                    ) -> None:
        load_rows(param, 0, weight, 0, 0, weight.shape[0], "replicated weight", self.packable)

    @staticmethod
    def load_full(param: nn.Parameter, weight: LazyWeight, shard_id: object = None) -> None:
        _copy_checked(param.data, weight.load(), "replicated weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_linear(x, self.bias)


class DataParallelLinear(nn.Module, Quantizable):
    """A replicated projection whose work can be split over tokens instead of repeated.

    Every rank holds the full weight, fused from several checkpoint tensors (`out_features`
    lists them, in order; `shard_ids` names them for the loader). `forward` is the replicated
    GEMM over all tokens. `forward_async` pads the tokens to a multiple of the world size (at
    least one per rank), multiplies only this rank's contiguous slice and starts gathering the
    slices: each rank does 1/tp of the GEMM, and `wait` drops the padding. Both give the same
    rows (each row's product does not depend on the other rows).
    """

    def __init__(self, in_features: int, out_features: Sequence[int], comm: Communicator, *,
                 shard_ids: Sequence[object], dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.comm = comm
        self.out_sizes = list(out_features)
        self.shard_ids = list(shard_ids)
        self.weight = _param(sum(self.out_sizes), in_features, dtype=dtype)
        self.weight.weight_loader = self.load_part
        self.weight.shard_ids = self.shard_ids

    def load_part(self, param: nn.Parameter, weight: LazyWeight, shard_id: object = None) -> None:
        index = self.shard_ids.index(shard_id)
        load_rows(param, sum(self.out_sizes[:index]), weight, 0, 0, weight.shape[0],
                  f"fused replicated part {shard_id}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_linear(x)

    def forward_async(self, x: torch.Tensor) -> Pending:
        """Start the token-split product; `wait(pending, x.shape[0])` returns all rows, as
        `forward(x)` would."""
        world, tokens = self.comm.world_size, x.shape[0]
        if world == 1:
            return (self.forward(x),)
        rows = max(1, -(-tokens // world))
        start = min(self.comm.rank * rows, tokens)
        local = x[start:start + rows]
        if local.shape[0] < rows:  # the tail ranks compute zero rows that are dropped again
            local = torch.cat([local, local.new_zeros(rows - local.shape[0], x.shape[1])])
        return self.comm.all_gather_async(self.forward(local))

    def wait(self, pending: Pending, tokens: int) -> torch.Tensor:
        """The product of all `tokens` rows that `forward_async` started."""
        return self.comm.wait_gather(pending)[:tokens]


class ColumnParallelLinear(nn.Module, Quantizable):
    """Output features split over ranks; each logical output (a shard) is split separately.

    `out_features` lists the logical outputs fused into one GEMM (one entry for a plain column
    linear, [gate, up] for a merged MLP projection). `shard_ranges[i]` is this rank's
    (start, size) within logical output i; by default an even split with remainders.
    """

    def __init__(self, in_features: int, out_features: Sequence[int], comm: Communicator, *,
                 shard_ranges: Sequence[tuple[int, int]] | None = None,
                 shard_ids: Sequence[object] | None = None, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if shard_ranges is None:
            shard_ranges = [split_range(o, comm.world_size, comm.rank) for o in out_features]
        self.shard_ranges = list(shard_ranges)
        self.shard_ids = list(shard_ids if shard_ids is not None else range(len(out_features)))
        self.local_sizes = [size for _, size in self.shard_ranges]
        self.weight = _param(sum(self.local_sizes), in_features, dtype=dtype)
        self.weight.weight_loader = self.load_shard
        self.bias = None
        if bias:
            self.bias = _param(sum(self.local_sizes), dtype=dtype)
            self.bias.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, weight: LazyWeight, shard_id: object = None) -> None:
        index = self.shard_ids.index(shard_id if shard_id is not None else self.shard_ids[0])
        start, size = self.shard_ranges[index]
        load_rows(param, sum(self.local_sizes[:index]), weight, 0, start, size,
                  f"column shard {shard_id}", self.packable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_linear(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one GEMM (gate and up)."""

    def __init__(self, in_features: int, out_features: Sequence[int], comm: Communicator, *,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(in_features, out_features, comm, dtype=dtype)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K and V projections; this rank's heads are given by a `HeadShard` (the queries
    of its `held` heads)."""

    def __init__(self, hidden_size: int, head_dim: int, heads: HeadShard, comm: Communicator, *,
                 bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        ranges = [
            (heads.held[0] * head_dim, heads.held[1] * head_dim),
            (heads.kv_start * head_dim, heads.kv_count * head_dim),
            (heads.kv_start * head_dim, heads.kv_count * head_dim),
        ]
        super().__init__(hidden_size, [size for _, size in ranges], comm, shard_ranges=ranges,
                         shard_ids=["q", "k", "v"], bias=bias, dtype=dtype)


class RowParallelLinear(nn.Module, Quantizable):
    """Input features split over ranks; partial outputs are summed over ranks.

    With `reduce=False` the caller owns the all-reduce (to launch it asynchronously, or to fuse
    it with a later one). `in_range` is this rank's (start, size) of the input features.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator, *,
                 in_range: tuple[int, int] | None = None, reduce: bool = True,
                 bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.comm = comm
        self.reduce = reduce
        self.in_features = in_features  # of the whole layer
        self.in_range = in_range or split_range(in_features, comm.world_size, comm.rank)
        self.weight = _param(out_features, self.in_range[1], dtype=dtype)
        self.weight.weight_loader = self.load_shard
        self.bias = None
        if bias:  # added once, on rank 0, so the sum over ranks counts it once
            self.bias = _param(out_features, dtype=dtype)
            self.bias.weight_loader = ReplicatedLinear.load_full

    def load_shard(self, param: nn.Parameter, weight: LazyWeight, shard_id: object = None) -> None:
        try:
            load_rows(param, 0, weight, 1, *self.in_range, "row shard")
        except ValueError as e:
            if weight.ggml_type is None:
                raise
            raise ValueError(f"row-parallel split at tp {self.comm.world_size}: {e} "
                             "(--quantization none computes from dequantized weights)") from e

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.comm.rank == 0 else None
        y = self.apply_linear(x, bias)
        return self.comm.all_reduce(y) if self.reduce else y
