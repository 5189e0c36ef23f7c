"""`bench-one-batch --backend llama.cpp`: the same workload through llama.cpp on the same GGUF
file (its own weight types, e.g. the embedded model's Q4_1), the comparison CPU users make.

llama-cpp-python compiles llama.cpp, so it is an optional dependency: `make bench-deps`. Its
low-level API runs the batch as braid does: every prompt is a sequence of one llama.cpp batch
(one `llama_decode` prefills them all, logits of each last token only), then one decode call
per step with one token per sequence, greedy. It runs as a `RankWorkload`, with one llama.cpp
thread per usable core.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np

from braid.bench.harness import BenchResult, RankWorkload, serve_runs, time_steps
from braid.config import EngineConfig
from braid.errors import UserError
from braid.platform import usable_cores


class LlamaCppWorkload(RankWorkload):
    """Batches of up to `max_batch` prompts of up to `max_tokens` tokens (prompt and output)."""

    def __init__(self, engine: EngineConfig, max_batch: int, max_tokens: int) -> None:
        if not Path(engine.model).is_file():
            raise UserError(f"--backend llama.cpp reads a GGUF file; {engine.model} is not one")
        if importlib.util.find_spec("llama_cpp") is None:
            raise UserError("--backend llama.cpp needs llama-cpp-python: run `make bench-deps` "
                            "(it compiles llama.cpp, several minutes)")
        super().__init__("llama.cpp", engine.parallel.tp, llama_cpp_worker,
                         (engine.model, max_batch, max_tokens))


def llama_cpp_worker(rank: int, world_size: int, conn, model: str, max_batch: int,
                     max_tokens: int) -> None:
    """Rank entry point for `LlamaCppWorkload`: load the model, then time each requested run."""
    runner = _LlamaCpp(model, max_batch, max_tokens)
    try:
        serve_runs(conn, runner.time)
    finally:
        runner.close()


class _LlamaCpp:
    """One llama.cpp model and context, with room for `max_batch` sequences."""

    def __init__(self, model: str, max_batch: int, max_tokens: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        # llama.cpp logs every load step to stderr; keep the callback referenced while set
        self._quiet = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(self._quiet, ctypes.c_void_p(0))
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(model.encode(),
                                                   lc.llama_model_default_params())
        if not self.model:
            raise UserError(f"llama.cpp could not load {model}")
        threads = len(usable_cores())
        params = lc.llama_context_default_params()
        params.n_ctx = max_batch * max_tokens
        params.n_batch = max_batch * max_tokens
        params.n_seq_max = max_batch
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise UserError("llama.cpp could not create a context for this batch")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(params.n_batch, 0, 1)

    def _fill(self, tokens: np.ndarray, start: int) -> None:
        """The batch: row b of `tokens` ([B, T]) as sequence b at positions start..start+T-1,
        logits of each row's last token."""
        batch = self.batch
        rows, length = tokens.shape
        for b in range(rows):
            for t in range(length):
                i = b * length + t
                batch.token[i] = int(tokens[b, t])
                batch.pos[i] = start + t
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = b
                batch.logits[i] = t == length - 1
        batch.n_tokens = rows * length

    def _decode(self, rows: int) -> np.ndarray:
        """Run the filled batch; the greedy next token of each of its `rows` sequences."""
        if self.lc.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(self.lc.llama_get_logits(self.ctx),
                                       shape=(rows, self.n_vocab))
        return logits.argmax(axis=1)

    def time(self, prompts: np.ndarray, output_len: int) -> BenchResult:
        """Prefill `prompts` ([B, T]) in one call, then `output_len - 1` greedy decode steps."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        rows, length = prompts.shape
        self._fill(prompts, 0)  # outside the timed call, as braid's plan is built in its step
        state = {"position": length}

        def prefill() -> None:
            state["next"] = self._decode(rows)

        def decode() -> None:
            self._fill(state["next"][:, None], state["position"])
            state["position"] += 1
            state["next"] = self._decode(rows)

        return time_steps(prefill, decode, output_len)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)
