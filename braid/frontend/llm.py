"""The offline API: `LLM(model=..., tp=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace
from itertools import count

import numpy as np
import torch

from braid.config import EngineConfig, StepSwitches
from braid.engine.core import EngineCore
from braid.engine.executor import RankExecutor
from braid.engine.request import Request, SamplingParams
from braid.errors import UserError
from braid.frontend.tracker import CompletionTracker, RequestOutput
from braid.loader.model_config import load_model_config
from braid.loader.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer
from braid.step import SequenceDelta


class LLM:
    """A model served by `tp` rank processes; the calling process schedules and tokenizes.

    `dtype="auto"` picks bf16 where the hardware computes it natively, else fp32. With
    `compile="auto"` (the default) steps are compiled once a `generate` call's job is long
    enough to repay it (`compile="on"`: at start; `"off"`: never).
    Keyword arguments beyond `model`, `tp` and `dtype` are the engine's other settings by
    their flags' names (`max_total_tokens`, `max_num_batched_tokens`, `prefix_caching`,
    `comm`, ...: `EngineConfig.create`). Use as a context manager or call `close()`.
    """

    def __init__(self, model: str | None = None, tp: int = 1, dtype: str = "auto",
                 **engine_args) -> None:
        self._start(EngineConfig.create(model=model, tp=tp, dtype=dtype, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An engine with these settings (as `LLM(**fields)` would make them)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = load_model_config(self.config.model, self.config.cache)
        executor = RankExecutor(self.config, self.model_config)
        try:
            # while the ranks load their weights
            self.tokenizer = load_tokenizer(self.config.model, self.config.cache)
            executor.wait_ready()
        except BaseException:
            executor.close()
            raise
        self.core = EngineCore(self.config, self.model_config, executor)
        if self.config.compile.mode == "on":
            self.core.compile_steps()
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        self._ids = count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the rank processes."""
        self.core.close()

    @property
    def switches(self) -> StepSwitches:
        """The per-step switches the next steps run with (overlap, DP linear, ...)."""
        return self.core.switches

    def switch(self, **changes: object) -> None:
        """Change per-step switches from the next step on (`switch(overlap="on")`): one
        launch can compare settings side by side."""
        self.core.switches = replace(self.core.switches, **changes)

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt: plain `tokenizer(prompt)`, or as a chat turn."""
        if chat:
            return apply_chat_template(self.tokenizer, prompt)
        return list(self.tokenizer(prompt)["input_ids"])

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> str:
        """Queue one tokenized request (it runs from the next `step()`); its request id."""
        request_id = str(next(self._ids))
        self.core.add(Request(request_id, list(prompt_ids), params, self.eos_token_ids))
        return request_id

    def step(self) -> list[SequenceDelta]:
        """Run one scheduled forward step on every rank; the deltas it produced."""
        return self.core.step()

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids) and return outputs in prompt order.
        All prompts are batched together; a request that cannot run raises `UserError`
        before anything starts."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        encoded = [self.encode(p, chat) if isinstance(p, str) else list(p) for p in prompts]
        for ids, p in zip(encoded, params_list):
            self.core.check_request(ids, p)
        self.core.compile_steps(sum(p.max_new_tokens * p.n for p in params_list))
        trackers = {}
        for ids, p in zip(encoded, params_list):
            request_id = self.add_request(ids, p)
            trackers[request_id] = CompletionTracker(request_id, self.tokenizer, ids, p)
        while self.core.has_work:
            for delta in self.core.step():
                applied = trackers[delta.request_id].apply(delta)
                if applied is not None and applied.abort:
                    self.core.abort(delta.request_id, delta.index)  # a stop string ended it
        return [tracker.output(prompt if isinstance(prompt, str) else None)
                for prompt, tracker in zip(prompts, trackers.values())]

    def embed(self, prompts: str | Seq[str] | Seq[Seq[int]], pooling: str = "last",
              normalize: bool = True) -> list[np.ndarray]:
        """One vector per prompt (text, or token ids), in prompt order: the final hidden
        states of its tokens pooled (`pooling`: the "last" token's, or the "mean"), unit
        length where `normalize`. All prompts are batched together like any prefill."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = SamplingParams(max_new_tokens=1, pooling=pooling)
        encoded = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids in encoded:
            self.core.check_request(ids, params)
        vectors: dict[str, np.ndarray] = {}
        order = [self.add_request(ids, params) for ids in encoded]
        while self.core.has_work:
            for delta in self.core.step():
                if delta.finish_reason == "error":
                    raise UserError(f"embedding a prompt failed: {delta.error}")
                if delta.embedding is not None:
                    vectors[delta.request_id] = delta.embedding
        out = [vectors[request_id] for request_id in order]
        return [v / np.linalg.norm(v) for v in out] if normalize else out

    def prompt_logits(self, prompts: Seq[Seq[int]]) -> list[torch.Tensor]:
        """fp32 logits at every position of each prompt (one batched prefill), for validation."""
        return self.core.prompt_logits([list(p) for p in prompts])
