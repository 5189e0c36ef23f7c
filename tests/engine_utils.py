"""Engine cores for tests: over a real model runner in this process, or over a fake model that
reads its answer from the KV cache (importable by test modules)."""

from __future__ import annotations

import numpy as np
import torch

from braid.config import EngineConfig
from braid.engine.core import EngineCore
from braid.engine.request import Request, SamplingParams
from braid.loader.model_config import ModelConfig
from braid.step import StepPlan, StepResult
from braid.worker.sampler import postprocess

FAKE_VOCAB = 1000
FAKE_EOS = 0


class RunnerExecutor:
    """A `ModelRunner` in this process as the engine's executor (one rank, no processes)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.readies = [runner.ready()]

    def step(self, plan: StepPlan, fill_masks=None) -> StepResult:
        return self.runner.step(plan, fill_masks)

    def check_alive(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeRunner:
    """A stand-in model whose next token is a hash of every token the sequence has in the KV
    cache, read back through the plan's block tables, so any mistake in slots, block tables,
    chunking, preemption or prefix sharing changes its outputs (or trips its checks).

    `nan_tokens`: a sequence whose last token is one of these gets NaN logits.
    """

    def __init__(self, config: EngineConfig, nan_tokens: tuple[int, ...] = ()) -> None:
        self.block_size = config.kv_cache.block_size
        self.cache = np.full(config.kv_cache.num_blocks
                             * config.kv_cache.block_size, -1, dtype=np.int64)
        self.nan_tokens = nan_tokens
        self.plans: list[StepPlan] = []
        self.generator = torch.Generator().manual_seed(0)
        self.readies: list = []  # a stand-in: no rank reports its memory

    def step(self, plan: StepPlan, fill_masks=None) -> StepResult:
        self.plans.append(plan)
        self.cache[plan.slot_mapping] = plan.input_ids
        rows = np.arange(plan.num_tokens) if plan.logit_rows is None else plan.logit_rows
        seq_of_token = np.repeat(np.arange(len(plan.q_lens)), plan.q_lens)
        logits = torch.zeros(len(rows), FAKE_VOCAB)
        for r, token in enumerate(rows):
            seq, pos = seq_of_token[token], plan.positions[token]
            positions = np.arange(pos + 1)
            slots = (plan.block_tables[seq, positions // self.block_size] * self.block_size
                     + positions % self.block_size)
            context = self.cache[slots]
            assert (context >= 0).all(), "read a KV slot that was never written"
            logits[r] = torch.linspace(0, 1, FAKE_VOCAB)  # a soft preference for high ids
            logits[r, fake_next_token(context)] = 8.0
            if context[-1] in self.nan_tokens:
                logits[r] = float("nan")
        return postprocess(logits, plan, self.generator, fill_masks and fill_masks())

    def check_alive(self) -> None:
        pass

    def close(self) -> None:
        pass


_HASH_PRIME = 1_000_003


def fake_next_token(context: np.ndarray) -> int:
    """The fake model's favourite next token: a polynomial hash of the whole context (order
    matters), never EOS."""
    powers = np.ones(len(context), dtype=np.int64)
    for i in range(1, len(context)):
        powers[i] = powers[i - 1] * 31 % _HASH_PRIME
    return int((context % _HASH_PRIME * powers % _HASH_PRIME).sum() % _HASH_PRIME
               % (FAKE_VOCAB - 1)) + 1


def fake_core(nan_tokens: tuple[int, ...] = (), **engine_args) -> tuple[EngineCore, FakeRunner]:
    """An engine core over `FakeRunner` (context 4096 tokens)."""
    config = EngineConfig.create(model="fake", dtype="fp32", **engine_args)
    model = ModelConfig("LlamaForCausalLM", FAKE_VOCAB, 8, 8, 1, 1, 1, 8, 1e-6, 1e4, 4096, False,
                        eos_token_ids=(FAKE_EOS,))
    runner = FakeRunner(config, nan_tokens)
    return EngineCore(config, model, runner), runner


def run_requests(core: EngineCore, prompts: list[list[int]], params: SamplingParams,
                 on_step=None, eos: int = FAKE_EOS) -> list[list[int]]:
    """Run each prompt as a request (ids "0", "1", ...) to completion; its first
    completion's tokens. Checks that every KV block is free afterwards. `on_step(core, step)`
    runs before each step (and may add requests of its own, whose tokens are not returned)."""
    outputs = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        core.add(Request(str(i), list(prompt), params, frozenset({eos})))
    step = 0
    while core.has_work:
        if on_step is not None:
            on_step(core, step)
        for delta in core.step():
            if delta.index == 0 and delta.request_id in outputs:
                outputs[delta.request_id] += delta.new_token_ids
        step += 1
    assert core.blocks.num_used == 0, "KV blocks leaked"
    return [outputs[str(i)] for i in range(len(prompts))]
