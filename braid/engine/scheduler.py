"""Decides each step: prefill waiting requests when they fit, else decode every running one.

Runs on the driver. KV blocks are allocated here; when the cache is full the newest running
request is preempted (its blocks freed, recomputed later), so no request is ever dropped.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from braid.engine.batch import SamplingBatch, StepPlan
from braid.engine.kv_cache import BlockAllocator
from braid.engine.request import Sequence


class Scheduler:
    """Continuous batching over a paged KV cache."""

    def __init__(self, allocator: BlockAllocator, max_prefill_tokens: int,
                 max_running: int, eos_token_ids: set[int], max_context: int) -> None:
        self.allocator = allocator
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = max_running
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[StepPlan, list[Sequence]]:
        """The next step's plan and the sequences in it (in plan order)."""
        batch = self._take_prefill()
        if not batch:
            batch = self._take_decode()
        return self.build_plan(batch), batch

    def _take_prefill(self) -> list[Sequence]:
        """Waiting sequences up to the prefill token budget; a prompt longer than what is left
        of the budget is prefilled in chunks over several steps (each chunk attends to the
        KV the earlier chunks cached)."""
        batch: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_computed
            chunk = min(remaining, budget)
            need = self.allocator.blocks_needed(seq.num_computed + chunk, len(seq.blocks))
            if need > self.allocator.num_free:
                if not batch and not self.running:
                    raise MemoryError(f"a request of {seq.num_tokens} tokens does not fit in the "
                                      f"KV cache ({self.allocator.capacity_tokens} tokens); "
                                      "raise --max-total-tokens")
                break
            seq.blocks += self.allocator.allocate(need)
            seq.scheduled_tokens = chunk
            batch.append(seq)
            budget -= chunk
            if chunk < remaining:  # stays first in line for its next chunk
                break
            self.running.append(self.waiting.popleft())
        return batch

    def _take_decode(self) -> list[Sequence]:
        batch = []
        preempted: set[int] = set()  # rids preempted below to make room for earlier sequences
        for seq in list(self.running):
            if seq.rid in preempted:
                continue
            need = self.allocator.blocks_needed(seq.num_tokens, len(seq.blocks))
            while need > self.allocator.num_free and self.running[-1] is not seq:
                preempted.add(self.running[-1].rid)
                self._preempt(self.running[-1])
            if need > self.allocator.num_free:
                self._preempt(seq)
                continue
            seq.blocks += self.allocator.allocate(need)
            seq.scheduled_tokens = 1
            batch.append(seq)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.allocator.free(seq.blocks)
        seq.blocks, seq.num_computed = [], 0
        self.waiting.appendleft(seq)

    def build_plan(self, batch: list[Sequence]) -> StepPlan:
        """The step plan for `batch`, each sequence computing its `scheduled_tokens`."""
        block_size = self.allocator.block_size
        q_lens = np.array([s.scheduled_tokens for s in batch], dtype=np.int64)
        kv_lens = np.array([s.num_computed + s.scheduled_tokens for s in batch], dtype=np.int64)
        positions = np.concatenate([np.arange(s.num_computed, end)
                                    for s, end in zip(batch, kv_lens)])
        input_ids = np.array([t for s, end in zip(batch, kv_lens)
                              for t in s.token_slice(s.num_computed, end)], dtype=np.int64)
        tables = np.zeros((len(batch), max(len(s.blocks) for s in batch)), dtype=np.int64)
        for row, s in enumerate(batch):
            tables[row, :len(s.blocks)] = s.blocks
        seq_index = np.repeat(np.arange(len(batch)), q_lens)
        slots = tables[seq_index, positions // block_size] * block_size + positions % block_size
        params = [s.params for s in batch]
        sampling = SamplingBatch(
            temperatures=np.array([p.temperature for p in params], dtype=np.float32),
            top_ks=np.array([p.top_k for p in params], dtype=np.int64),
            top_ps=np.array([p.top_p for p in params], dtype=np.float32),
            seeds=[p.seed for p in params],
            output_positions=np.array([len(s.output_ids) for s in batch], dtype=np.int64),
        )
        return StepPlan(input_ids, positions.astype(np.int64), slots.astype(np.int64), q_lens,
                        kv_lens, tables, sampling)

    def commit(self, batch: list[Sequence], next_tokens: list[int]) -> list[Sequence]:
        """Record the step's sampled tokens; return the sequences that finished.

        A sequence whose prompt is only partly prefilled discards its token: it was sampled
        from the middle of the prompt.
        """
        finished = []
        for seq, token in zip(batch, next_tokens):
            seq.num_computed += seq.scheduled_tokens
            if seq.num_computed < seq.num_tokens:
                continue
            seq.output_ids.append(token)
            params = seq.params
            if token in params.stop_token_ids or (
                    not params.ignore_eos and token in self.eos_token_ids):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= params.max_new_tokens or seq.num_tokens >= self.max_context:
                seq.finish_reason = "length"
            if seq.finished:
                self.running.remove(seq)
                self.allocator.free(seq.blocks)
                seq.blocks = []
                finished.append(seq)
        return finished
