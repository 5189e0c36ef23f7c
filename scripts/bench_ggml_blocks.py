"""One GEMM over a GGUF format's blocks (`torch.ops.braid.ggml_linear`) against the dense
few-row kernel on a bf16 weight of the same shape: milliseconds a call and weights a second.

    python scripts/bench_ggml_blocks.py --rows 8192 --columns 2048 --threads 1 --inputs 1

The blocks are random bytes with small fp16 scales (any bytes are valid blocks)."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from braid import native

FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K"]
# Where each format keeps its fp16 scale (and minimum) in a block
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,)}


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
    args = parser.parse_args()
    if not native.load(announce=True):
        raise SystemExit("braid's C++ operators could not be built")
    torch.set_num_threads(args.threads)
    x = torch.randn(args.inputs, args.columns).bfloat16()
    dense = torch.randn(args.rows, args.columns).bfloat16()
    weights = args.rows * args.columns
    ms = milliseconds(lambda: torch.ops.braid.few_rows_linear(x, dense))
    print(f"dense bf16: {ms:.2f} ms ({weights / ms / 1e6:.1f} G weights/s)")
    for name in FORMATS:
        blocks, kind = random_blocks(name, args.rows, args.columns), GGMLQuantizationType[name]
        ms = milliseconds(lambda b=blocks, k=int(kind): torch.ops.braid.ggml_linear(x, b, k, 32))
        print(f"{name}: {ms:.2f} ms ({weights / ms / 1e6:.1f} G weights/s), "
              f"{blocks.numel() / weights:.2f} bytes a weight")


if __name__ == "__main__":
    main()
