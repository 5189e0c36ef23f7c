"""Embedding throughput: braid (`LLM.embed`, batched like any prefill, at --tp) against
Hugging Face transformers (`AutoModel`, batches of --hf-batch) on the same checkpoint and the
same random token ids, one after the other (never both at once), and how far apart their
vectors are.

    python scripts/bench_embeddings.py --tp 2 --dtype fp32 [--model FOLDER]

Without --model, a random Qwen3 of braid's `bench` preset is made in a temporary folder.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def braid_vectors(model: str, tp: int, dtype: str, prompts: list[list[int]],
                  pooling: str) -> tuple[list[np.ndarray], float]:
    from braid.frontend.llm import LLM

    with LLM(model, tp=tp, dtype=dtype) as llm:
        llm.embed(prompts[:8], pooling=pooling)  # first-call costs
        start = time.perf_counter()
        vectors = llm.embed(prompts, pooling=pooling)
        return vectors, time.perf_counter() - start


def hf_vectors(model: str, dtype: str, prompts: list[list[int]], pooling: str,
               batch: int) -> tuple[list[np.ndarray], float]:
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model, torch_dtype=TORCH_DTYPES[dtype]).eval()
    vectors = []
    with torch.inference_mode():
        hf(torch.tensor(prompts[:8]))  # first-call costs
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            hidden = hf(torch.tensor(prompts[i:i + batch])).last_hidden_state.float()
            pooled = hidden[:, -1] if pooling == "last" else hidden.mean(1)
            vectors += list(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        return vectors, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a safetensors folder (default: a random Qwen3)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="fp32")
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--pooling", choices=("last", "mean"), default="last")
    parser.add_argument("--hf-batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            from braid.random_model import make_random_model

            model = str(make_random_model("qwen3", "bench", f"{scratch}/qwen3", dtype="bf16"))
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        prompts = np.random.default_rng(0).integers(
            100, vocab, (args.num_inputs, args.input_len)).tolist()
        ours, braid_s = braid_vectors(model, args.tp, args.dtype, prompts, args.pooling)
        theirs, hf_s = hf_vectors(model, args.dtype, prompts, args.pooling, args.hf_batch)
    tokens = args.num_inputs * args.input_len
    distance = max(1 - float(np.dot(a, b)) for a, b in zip(ours, theirs))
    print(f"{args.num_inputs} inputs x {args.input_len} tokens, {args.dtype}, "
          f"{args.pooling} pooling")
    print(f"braid tp {args.tp}: {braid_s:6.2f} s  {args.num_inputs / braid_s:7.1f} inputs/s  "
          f"{tokens / braid_s:8.0f} tok/s")
    print(f"transformers:  {hf_s:6.2f} s  {args.num_inputs / hf_s:7.1f} inputs/s  "
          f"{tokens / hf_s:8.0f} tok/s  (batches of {args.hf_batch})")
    print(f"ratio {hf_s / braid_s:.2f}x; largest cosine distance between their vectors: "
          f"{distance:.2e}")


if __name__ == "__main__":
    main()
