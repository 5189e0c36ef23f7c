"""One GEMM over a GGUF format's blocks (`torch.ops.braid.ggml_linear`) against a dense
weight of the same shape (the few-row kernel where it serves the dtype, else ATen's GEMM):
milliseconds a call and weights a second; every format also interleaved 16 rows to a group
(`ggml_weight.interleave_rows`) where the int8 kernel serves it, its int8 inputs at any row
count.

    python scripts/bench_ggml_blocks.py --rows 8192 --columns 2048 --threads 1 --inputs 1
    python scripts/bench_ggml_blocks.py --dtype fp32 --block-inputs float  # AVX2 hosts

The blocks are random bytes with small fp16 scales (any bytes are valid blocks)."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from braid import native
from braid.layers import decode_kernel
from braid.layers.ggml_weight import (
    ALL_ROWS,
    FEW_ROWS,
    INTERLEAVED_TYPES,
    X16,
    X16_ROWS,
    interleave_rows,
    rounds_inputs,
)

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K"]
# Where each format keeps its fp16 scale (and minimum) in a block
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
           "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(name: str, rows: int, columns: int) -> torch.Tensor:
    elements, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, columns // elements, nbytes), dtype=np.uint8)
    for offset in _HALVES[name]:
        halves = rng.uniform(1e-3, 2e-2, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = halves[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def milliseconds(call, repeats: int = 20) -> float:
    call(), call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--columns", type=int, default=2048)
    parser.add_argument("--inputs", type=int, default=1, help="input rows (the GEMM's M)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--block-inputs", choices=["int8", "float"], default="int8",
                        help="as braid's setting: int8 where this CPU's int8 kernels serve")
    args = parser.parse_args()
    if not native.load(announce=True):
        raise SystemExit("braid's C++ operators could not be built")
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x = torch.randn(args.inputs, args.columns).to(dtype)
    dense = torch.randn(args.rows, args.columns).to(dtype)
    dense_linear = (decode_kernel.few_rows_linear if decode_kernel.few_rows_fits(dense)
                    else torch.nn.functional.linear)
    weights = args.rows * args.columns
    ms = milliseconds(lambda: dense_linear(x, dense))
    print(f"dense {args.dtype}: {ms:.2f} ms ({weights / ms / 1e6:.1f} G weights/s)")
    round_inputs = args.block_inputs == "int8"
    int8_rows = FEW_ROWS if round_inputs else 0
    for name in FORMATS:
        blocks, kind = random_blocks(name, args.rows, args.columns), GGMLQuantizationType[name]
        ms = milliseconds(lambda b=blocks, k=int(kind): torch.ops.braid.ggml_linear(
            x, b, k, FEW_ROWS, int8_rows))
        print(f"{name}: {ms:.2f} ms ({weights / ms / 1e6:.1f} G weights/s), "
              f"{blocks.numel() / weights:.2f} bytes a weight")
        interleaved = X16 + int(kind)
        if (round_inputs and int(kind) in INTERLEAVED_TYPES and args.rows % X16_ROWS == 0
                and rounds_inputs(interleaved, dtype, args.columns)):
            groups = interleave_rows(blocks, int(kind))
            ms = milliseconds(lambda g=groups, k=interleaved: torch.ops.braid.ggml_linear(
                x, g, k, FEW_ROWS, ALL_ROWS))
            print(f"{name}, interleaved: {ms:.2f} ms ({weights / ms / 1e6:.1f} G weights/s)")


if __name__ == "__main__":
    main()
