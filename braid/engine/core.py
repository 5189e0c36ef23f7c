"""The engine core: requests in, per-sequence deltas out, one forward step at a time.

`EngineCore` owns the scheduler and the KV block manager and drives an executor (the rank
processes, or a runner in this process for tests). The offline `LLM` drives it in-process; the
server's engine process drives it in a loop of its own. It knows token ids only: tokenizing,
detokenizing and stop strings belong to the front ends.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import replace
from itertools import count

import numpy as np
import torch

from braid.config import EngineConfig
from braid.distributed.ranks.torchrun import ranks_span_hosts
from braid.engine.draft import RankDraftProposer
from braid.engine.executor import Executor
from braid.engine.grammar import Grammars
from braid.engine.kv_cache import BlockManager
from braid.engine.plan import SequenceRows, build_plan
from braid.engine.request import Request, SamplingParams, Sequence, check_request
from braid.engine.scheduler import Scheduler
from braid.engine.speculation import (
    LayerProposals,
    NgramProposer,
    Speculator,
    step_times_file,
)
from braid.engine.stats import EngineStats, RankMemory
from braid.engine.step_choice import StepChooser, describe, step_bucket, step_settings
from braid.errors import UserError, request_failure
from braid.loader.model_config import ModelConfig
from braid.loader.tokenizer import eos_token_ids, load_tokenizer
from braid.models.registry import model_class
from braid.platform import process_namespace, resident_bytes
from braid.step import SequenceDelta, StepMode, StepPlan, StepResult

# Seconds between two reads of the ranks' resident memory for the stats
RANK_MEMORY_REFRESH_S = 1.0
# `--compile auto` compiles for a job of at least this many tokens to generate (`generate`,
# `LLM.generate`), by whether the graphs are saved: loading them and compiling the pieces is
# soon repaid by compiled decode steps, compiling cold takes minutes (figures:
# docs/performance.md, "Compiled steps").
AUTO_COMPILE_MIN_TOKENS = {True: 512, False: 16384}


def auto_compile_pays(job_tokens: int, cached: bool) -> bool:
    """Whether `--compile auto` compiles for a job of `job_tokens` tokens to generate."""
    return job_tokens >= AUTO_COMPILE_MIN_TOKENS[cached]


class EngineError(RuntimeError):
    """The engine cannot go on (a rank's answer does not belong to the step asked)."""


class EngineCore:
    """Requests in (`add`, `abort`), per-sequence deltas out (`step`)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 executor: Executor) -> None:
        self.config = config
        self.model_config = model_config
        self.executor = executor
        self.blocks = BlockManager(config.kv_cache)
        self.scheduler = Scheduler(self.blocks, config.scheduler,
                                   model_config.max_position_embeddings)
        # The per-step switches: a benchmark replaces them between steps to compare settings
        self.switches = config.switches
        self._has_dp_linear = model_class(model_config).has_dp_linear
        # Compressed sums pay only where a network is slower than the compute: across hosts.
        self._compression_learned = config.parallel.tp > 1 and ranks_span_hosts()
        self.chooser = StepChooser()
        self.grammars = Grammars(lambda: load_tokenizer(config.model, config.cache),
                                 model_config.vocab_size,
                                 lambda tokenizer: eos_token_ids(model_config, tokenizer))
        self._sequences: dict[str, list[Sequence]] = {}
        self.compile_grammars_aside = False  # see `add`
        # Requests whose grammar the grammar thread compiles: the request and its future
        self._compiling: dict[str, tuple[Request, Future]] = {}
        self._seq_ids = count()
        self._step_ids = count(1)
        self.num_steps = self.num_steps_overlap = self.num_steps_dp_linear = 0
        self.num_sequences_received = 0
        self.steps_by_path: Counter[str] = Counter()
        self.last_path = ""  # the path the latest step took (`StepResult.path`)
        self._rank_memory: list[RankMemory] = []
        self._rank_memory_read_at = -RANK_MEMORY_REFRESH_S
        self.compiled = False
        self.speculator = None
        self.layer_proposals: LayerProposals | None = None
        if config.speculative.method == "ngram":
            proposer = NgramProposer(config.speculative.ngram_min, config.speculative.ngram_max)
            self.speculator = Speculator(proposer, config.speculative.num_tokens,
                                         step_times_file(config))
        elif config.speculative.method == "mtp":
            # One layer predicts one token; its proposals come with each step's tokens
            self.layer_proposals = LayerProposals()
            self.speculator = Speculator(self.layer_proposals, 1, step_times_file(config))
        elif config.speculative.method == "draft":
            proposer = RankDraftProposer(config.kv_cache.block_size,
                                         config.scheduler.max_num_batched_tokens)
            self.speculator = Speculator(proposer, config.speculative.num_tokens,
                                         step_times_file(config), draft_model=True)

    def compile_steps(self, job_tokens: int | None = None) -> None:
        """Compile (or load saved) steps where `--compile` asks for them: `on` at once, `auto`
        for a server or benchmark (`job_tokens` None) and for a job whose tokens to generate
        repay it (`auto_compile_pays`); prints what it does. Once per engine."""
        status, mode = self.executor.ready, self.config.compile.mode
        if self.compiled or mode == "off":
            return
        if status.not_compiled is not None:
            if mode == "on":
                print(f"braid: --compile on: steps run eager ({status.not_compiled})",
                      file=sys.stderr, flush=True)
            self.compiled = True  # nothing to do, ever
            return
        if mode == "auto" and job_tokens is not None and not auto_compile_pays(job_tokens,
                                                                              status.cached):
            return
        what = ("loading the saved graphs" if status.cached else
                "compiling the decode graphs and pieces: a few minutes, once; saved for later "
                "starts")
        print(f"braid: compiled steps: {what}", file=sys.stderr, flush=True)
        print(f"braid: {self.executor.prepare_compiled()}", file=sys.stderr, flush=True)
        self.compiled = True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def close(self) -> None:
        """Stop the executor (the rank processes); keep what speculation measured."""
        if self.speculator is not None:
            self.speculator.save()
        self.executor.close()

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise `UserError` if a request can never run (see `check_request`) or its
        grammar does not compile for this model (compiled once, kept for `add`)."""
        check_request(prompt_ids, params, self.model_config, self.blocks.capacity_tokens)
        if params.structured is not None:
            self.grammars.matcher(params.structured)

    def add(self, request: Request) -> None:
        """Queue a request's `n` sequences; `UserError` if it can never run. With the prefix
        cache on, siblings share the first one's prompt blocks (see the scheduler).

        With `compile_grammars_aside` set (a server's engine), a grammar not compiled yet is
        compiled in the grammar thread while steps run: the request is queued by the
        `admit_compiled` after that, or fails there."""
        self.num_sequences_received += request.params.n
        if request.request_id in self._sequences or request.request_id in self._compiling:
            raise UserError(f"request id {request.request_id!r} is already in use")
        structured = request.params.structured
        if (self.compile_grammars_aside and structured is not None
                and not self.grammars.is_compiled(structured)):
            check_request(request.prompt_ids, request.params, self.model_config,
                          self.blocks.capacity_tokens)
            self._compiling[request.request_id] = (request, self.grammars.compile_aside(structured))
            return
        self._queue(request)

    def _queue(self, request: Request) -> None:
        self.check_request(request.prompt_ids, request.params)
        structured = request.params.structured
        seqs = [Sequence(next(self._seq_ids), request.request_id, i, list(request.prompt_ids),
                         request.params, request.eos_token_ids,
                         group=request.group or request.request_id,
                         grammar=structured and self.grammars.matcher(structured))
                for i in range(request.params.n)]
        self._sequences[request.request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def admit_compiled(self) -> list[tuple[Request, Exception]]:
        """Queue the requests whose grammar the grammar thread has compiled since; those whose
        grammar failed, with the error (the grammar's `UserError`, a 400)."""
        failed = []
        for request_id, (request, compiled) in list(self._compiling.items()):
            if compiled.done():
                del self._compiling[request_id]
                try:
                    compiled.result()
                    self._queue(request)
                except Exception as e:  # noqa: BLE001 - the request's failure, not the engine's
                    failed.append((request, e))
        return failed

    @property
    def num_compiling(self) -> int:
        """Sequences whose request waits for its grammar to compile."""
        return sum(request.params.n for request, _ in self._compiling.values())

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request's sequences (or only completion `index`); their KV blocks are free
        at once. Unknown or finished requests are ignored (the race is the client's)."""
        if index is None and self._compiling.pop(request_id, None) is not None:
            return  # its grammar compiles on, for the next request that asks for it
        for seq in self._sequences.get(request_id, []):
            if (index is None or seq.index == index) and not seq.finished:
                self.scheduler.abort(seq)
        self._forget_if_done(request_id)

    def _forget_if_done(self, request_id: str) -> None:
        if all(seq.finished for seq in self._sequences.get(request_id, [])):
            self._sequences.pop(request_id, None)

    def step(self) -> list[SequenceDelta]:
        """Run one scheduled step; one delta per sequence that got a token or finished
        (nothing when nothing is waiting or running). A sequence whose plan cannot be built
        fails alone; the others run."""
        start = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.decoding())
        batch = self.scheduler.schedule()
        if not batch:
            return []
        failed: list[SequenceDelta] = []
        try:
            plan, layout = build_plan(batch, self.config.kv_cache.block_size, next(self._step_ids))
        except Exception:  # noqa: BLE001 - find the sequences that explain it; they fail alone
            batch, failed = self._drop_unplannable(batch)
            if batch:
                plan, layout = build_plan(batch, self.config.kv_cache.block_size,
                                          next(self._step_ids))
        deltas = failed
        if batch:
            draft = self.speculator and self.speculator.proposer
            if isinstance(draft, RankDraftProposer):  # the ranks' draft model fills the drafts
                plan.draft = draft.plan(batch, {seq.seq_id for seq in self.scheduler.running})
            result = self._run(plan, batch, layout)
            if isinstance(draft, RankDraftProposer):
                draft.receive(batch, result)
            deltas += self.scheduler.commit(batch, layout, result)
            if self.layer_proposals is not None:
                self.layer_proposals.receive(batch, layout, result.proposals)
            if plan.draft is not None:
                self.speculator.observe_draft(plan.draft, result.draft_seconds)
            if self.speculator is not None and (plan.q_lens == 1).all():
                # The whole step, the proposals and the commit included: what speculation
                # costs a client, also where the engine's own work competes for the cores
                self.speculator.observe_step(len(plan.q_lens), time.perf_counter() - start,
                                             sum(result.draft_seconds))
        for delta in deltas:
            if delta.finish_reason is not None:
                self._forget_if_done(delta.request_id)
        return deltas

    def _drop_unplannable(self, batch: list[Sequence]
                          ) -> tuple[list[Sequence], list[SequenceDelta]]:
        """The sequences of `batch` whose own plan can be built, and an error delta for each
        of the others (they are finished)."""
        kept, failed = [], []
        for seq in batch:
            try:
                build_plan([seq], self.config.kv_cache.block_size, 0)
                kept.append(seq)
            except Exception as e:  # noqa: BLE001
                failed.append(self.scheduler.fail(seq, request_failure("planning its step", e)))
        return kept, failed

    def _run(self, plan: StepPlan, batch: list[Sequence] = (),
             layout: list[SequenceRows] = ()) -> StepResult:
        decode = bool((plan.q_lens == 1).all())
        graphs = self.compiled and self.executor.ready.decode_graph
        settings = step_settings(self.switches, plan.num_tokens, self.config.parallel.tp,
                                 self._has_dp_linear, self._compression_learned,
                                 graph_decode=decode and graphs)
        bucket = step_bucket(plan.num_tokens, decode)
        setting, probe = self.chooser.choose(bucket, settings)
        chosen = dict(setting)
        why = f"{bucket} {'probe' if probe else 'chosen'}: {describe(setting)}"
        plan.mode = StepMode(overlap=chosen["overlap"], dp_linear=chosen.get("dp_linear", False),
                             comm_compression=chosen["compression"],
                             skip_comm=self.switches.skip_comm,
                             choice=why if len(settings) > 1 else "")
        constrained = [(rows.sample_row, seq.grammar) for seq, rows in zip(batch, layout)
                       if seq.grammar is not None and rows.sample_row is not None]
        fill_masks, mask_errors = None, {}
        if constrained:
            plan.sampling.grammar_rows = np.array([row for row, _ in constrained],
                                                  dtype=np.int64)

            def fill_masks() -> np.ndarray:
                mask, errors = self.grammars.fill([matcher for _, matcher in constrained])
                mask_errors.update({constrained[i][0]: error for i, error in errors.items()})
                return mask

        start = time.perf_counter()
        result = self.executor.step(plan, fill_masks)
        seconds = time.perf_counter() - start
        self.chooser.observe(bucket, setting, seconds, plan.num_tokens)
        if result.step_id != plan.step_id:
            raise EngineError(f"rank 0 answered step {result.step_id} when asked for step "
                              f"{plan.step_id}: a reply was left over from an interrupted step")
        for row, error in mask_errors.items():  # sampled without its mask: not a valid token
            result.tokens[row] = None
            result.errors[row] = f"the grammar failed: {error}"
        self.grammars.times.wait_s += result.grammar_wait_s
        self.num_steps += 1
        self.num_steps_overlap += plan.mode.overlap
        self.num_steps_dp_linear += plan.mode.dp_linear
        self.steps_by_path[result.path] += 1
        self.last_path = result.path
        return result

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting) + self.num_compiling,
                           self.blocks.usage, s.prefix_queries,
                           s.prefix_hits, s.num_preemptions, self.num_steps,
                           self.num_steps_overlap, self.num_steps_dp_linear,
                           dict(self.steps_by_path), self.num_sequences_received,
                           s.num_draft_tokens, s.num_accepted_tokens,
                           self.chooser.choices(), self.chooser.probe_steps,
                           replace(self.grammars.times), self.rank_memory())

    def rank_memory(self) -> list[RankMemory]:
        """Each rank's weights and KV cache, as it reported them, and its process's resident
        memory (read where the rank's process is visible from here, at most every
        RANK_MEMORY_REFRESH_S: stats go out with every step)."""
        now = time.monotonic()
        if now - self._rank_memory_read_at >= RANK_MEMORY_REFRESH_S:
            here = process_namespace()
            self._rank_memory = [
                RankMemory(r.weight_bytes, r.kv_cache_bytes,
                           resident_bytes(r.pid) if r.pid and r.namespace == here else 0)
                for r in self.executor.readies]
            self._rank_memory_read_at = now
        return self._rank_memory

    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits at every position of each prompt (one batched prefill, outside the
        scheduler and the prefix cache), for validation."""
        seqs = [Sequence(next(self._seq_ids), "", 0, list(p), SamplingParams()) for p in prompts]
        try:
            for seq in seqs:
                seq.blocks = self.blocks.allocate(self.blocks.blocks_needed(seq.num_tokens, 0))
                seq.scheduled_tokens = seq.num_tokens
            plan, _ = build_plan(seqs, self.config.kv_cache.block_size, next(self._step_ids))
            result = self._run(replace(plan, logit_rows=None, sample_rows=None, sampling=None,
                                       prompt_logprobs=None, return_logits=True))
        finally:
            for seq in seqs:
                self.blocks.free(seq.blocks)
        return list(result.logits.split([len(p) for p in prompts]))
