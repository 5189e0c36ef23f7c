"""The offline API: `LLM(model=..., tp=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace
from itertools import count

import torch

from braid.config import (
    EngineConfig,
    UserError,
    auto_switch,
    default_model_path,
    load_model_config,
)
from braid.distributed.launch import launch_ranks
from braid.distributed.shm import ShmSegment, activation_slot_bytes
from braid.engine.batch import StepPlan
from braid.engine.kv_cache import BlockAllocator
from braid.engine.model_runner import StepResult
from braid.engine.request import RequestOutput, SamplingParams, Sequence
from braid.engine.scheduler import Scheduler
from braid.engine.tokenizer import apply_chat_template, load_tokenizer
from braid.engine.worker import worker_main
from braid.models.registry import model_class


class LLM:
    """A model served by `tp` rank processes; the calling process schedules and tokenizes.

    `dtype="auto"` picks bf16 where the hardware computes it natively, else fp32.
    Keyword arguments beyond `model`, `tp` and `dtype` are `EngineConfig` fields
    (`max_total_tokens`, `comm`, `skip_comm`, ...). Use as a context manager or call `close()`.
    """

    def __init__(self, model: str | None = None, tp: int = 1, dtype: str = "auto",
                 **engine_args) -> None:
        self.config = EngineConfig(model=model or default_model_path(), tp=tp, dtype=dtype,
                                   **engine_args)
        self.model_config = load_model_config(self.config.model)
        # Refuse an unsupported architecture or split before launching.
        model_class(self.model_config).check_config(self.model_config, tp)
        segment = None
        if self.config.comm == "shm" and tp > 1:
            segment = ShmSegment.create(tp, slot_bytes=activation_slot_bytes(
                self.config.max_prefill_tokens, self.model_config.widest_activation,
                self.config.torch_dtype.itemsize))
        try:
            self.ranks = launch_ranks(tp, worker_main, (self.config, self.model_config, segment),
                                      cleanup=segment.unlink if segment else None)
        except BaseException:
            if segment is not None:
                segment.unlink()
            raise
        try:
            self.tokenizer = load_tokenizer(self.config.model)  # while the ranks load weights
            self.ranks.gather()  # every rank reports ready
        except BaseException:
            self.ranks.close()
            raise
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.allocator = BlockAllocator(self.config.max_total_tokens, self.config.block_size)
        self.scheduler = Scheduler(self.allocator, self.config.max_prefill_tokens,
                                   self.config.max_running_requests, eos,
                                   self.model_config.max_position_embeddings)
        self._ids = count()
        # Per-step policy, changeable between steps (benchmarks compare settings in one launch).
        self.overlap = self.config.overlap
        self.overlap_min_tokens = self.config.overlap_min_tokens
        self.skip_comm = self.config.skip_comm
        self.dp_linear = self.config.dp_linear
        self.dp_linear_min_tokens = self.config.dp_linear_min_tokens

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the rank processes."""
        self.ranks.close()

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt: plain `tokenizer(prompt)`, or as a chat turn."""
        if chat:
            return apply_chat_template(self.tokenizer, prompt)
        return list(self.tokenizer(prompt)["input_ids"])

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue one tokenized request; it runs at the next `step()`."""
        context = self.model_config.max_position_embeddings
        if not prompt_ids:
            raise UserError("a prompt must have at least one token")
        if len(prompt_ids) >= context:
            raise UserError(f"prompt of {len(prompt_ids)} tokens does not fit the model's "
                            f"context of {context} tokens")
        if len(prompt_ids) + 1 > self.allocator.capacity_tokens:
            raise UserError(f"prompt of {len(prompt_ids)} tokens exceeds the KV cache "
                            f"({self.allocator.capacity_tokens} tokens); raise --max-total-tokens")
        bad = [t for t in prompt_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary "
                            f"(0..{self.model_config.vocab_size - 1})")
        seq = Sequence(next(self._ids), list(prompt_ids), params)
        self.scheduler.add(seq)
        return seq

    def _run(self, plan: StepPlan) -> StepResult:
        plan.overlap = auto_switch(self.overlap, plan.num_tokens, self.overlap_min_tokens,
                                   self.config.tp)
        plan.skip_comm = self.skip_comm
        plan.dp_linear = auto_switch(self.dp_linear, plan.num_tokens,
                                     self.dp_linear_min_tokens, self.config.tp)
        return self.ranks.request(("step", plan))

    def step(self) -> list[Sequence]:
        """Run one scheduled forward step on every rank; return the sequences that finished."""
        plan, batch = self.scheduler.schedule()
        return self.scheduler.commit(batch, self._run(plan).next_tokens)

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 chat: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids) and return outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise UserError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        seqs = []
        for prompt, p in zip(prompts, params_list):
            ids = self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt)
            seqs.append((prompt if isinstance(prompt, str) else None, self.add_request(ids, p)))
        while self.scheduler.has_work:
            self.step()
        return [
            RequestOutput(prompt, seq.prompt_ids,
                          self.tokenizer.decode(seq.output_ids, skip_special_tokens=True),
                          seq.output_ids, seq.finish_reason)
            for prompt, seq in seqs
        ]

    def prompt_logits(self, prompts: Seq[Seq[int]]) -> list[torch.Tensor]:
        """fp32 logits at every position of each prompt (one batched prefill), for validation."""
        seqs = [Sequence(next(self._ids), list(p), SamplingParams(max_new_tokens=1))
                for p in prompts]
        for seq in seqs:
            seq.blocks = self.allocator.allocate(
                self.allocator.blocks_needed(seq.num_tokens, 0))
            seq.scheduled_tokens = seq.num_tokens
        try:
            plan = replace(self.scheduler.build_plan(seqs), sampling=None, return_logits="all")
            result = self._run(plan)
        finally:
            for seq in seqs:
                self.allocator.free(seq.blocks)
        return list(result.logits.split([len(p) for p in prompts]))
