"""The offline API: `LLM(model=..., tp=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from itertools import count

import torch

from braid.config import EngineConfig, UserError, default_model_path
from braid.engine.core import EngineCore, RankExecutor, StepPolicy
from braid.engine.output import CompletionState
from braid.engine.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    SamplingParams,
    SequenceDelta,
)
from braid.engine.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer
from braid.loader.model_config import load_model_config


class LLM:
    """A model served by `tp` rank processes; the calling process schedules and tokenizes.

    `dtype="auto"` picks bf16 where the hardware computes it natively, else fp32. With
    `compile="auto"` (the default) steps are compiled once a `generate` call's job is long
    enough to repay it (`compile="on"`: at start; `"off"`: never).
    Keyword arguments beyond `model`, `tp` and `dtype` are `EngineConfig` fields
    (`max_total_tokens`, `max_num_batched_tokens`, `prefix_caching`, `comm`, ...). Use as a
    context manager or call `close()`.
    """

    def __init__(self, model: str | None = None, tp: int = 1, dtype: str = "auto",
                 **engine_args) -> None:
        self._start(EngineConfig(model=model or default_model_path(), tp=tp, dtype=dtype,
                                 **engine_args))

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
        if self.config.compile == "on":
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
    def policy(self) -> StepPolicy:
        """Per-step switches (overlap, DP linear, skip-comm), changeable between steps."""
        return self.core.policy

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
        states: dict[str, list[CompletionState]] = {}
        outputs: dict[str, RequestOutput] = {}
        order = []
        for prompt, ids, p in zip(prompts, encoded, params_list):
            request_id = self.add_request(ids, p)
            order.append(request_id)
            states[request_id] = [CompletionState(self.tokenizer, ids, p, i) for i in range(p.n)]
            outputs[request_id] = RequestOutput(prompt if isinstance(prompt, str) else None,
                                                ids, [])
        while self.core.has_work:
            for delta in self.core.step():
                self._apply(delta, states[delta.request_id], outputs[delta.request_id])
        for request_id in order:
            outputs[request_id].outputs = [
                CompletionOutput(s.index, s.text, s.token_ids, s.finish_reason, s.stop_reason,
                                 s.logprobs, s.error) for s in states[request_id]]
        return [outputs[request_id] for request_id in order]

    def _apply(self, delta: SequenceDelta, states: list[CompletionState],
               output: RequestOutput) -> None:
        state = states[delta.index]
        if delta.prompt_logprobs is not None and output.prompt_logprobs is None:
            output.prompt_logprobs = [None, *delta.prompt_logprobs]
        if delta.num_prompt_tokens:
            output.num_cached_tokens = delta.num_cached_tokens
        was_finished = state.finished
        state.update(delta)
        if state.finished and not was_finished and delta.finish_reason is None:
            self.core.abort(delta.request_id, delta.index)  # a stop string ended it

    def prompt_logits(self, prompts: Seq[Seq[int]]) -> list[torch.Tensor]:
        """fp32 logits at every position of each prompt (one batched prefill), for validation."""
        return self.core.prompt_logits([list(p) for p in prompts])
