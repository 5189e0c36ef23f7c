"""Continuous batching with a token budget over a paged, prefix-cached KV cache.

Each step, within `max_num_batched_tokens` tokens:
1. every running sequence that is decoding gets its next token, oldest first. When the cache
   is full the newest running sequence is preempted (its blocks freed, recomputed later, its
   prefix likely still cached), so no request is ever dropped;
2. prompts part-way through their prefill get their next chunk, as far as free blocks allow;
3. waiting sequences are admitted while their first chunk fits with a reserve of free blocks
   for the running sequences' next decode step, so a fresh admission does not preempt anyone
   right away; the shared prefix found in the prefix cache is skipped. Preempted sequences come
   first; then groups (the server's HTTP requests) take turns, one sequence each, the group
   served longest ago first, so a request of thousands of prompts does not hold back another
   client's one. A sequence that does not fit yet is overtaken by the ones behind it for at
   most `max_skip_age_s` seconds; after that admission waits for it, so it is not starved. A
   sequence whose next uncached block another prompt is computing right now (the same
   few-shot prefix, a sibling of `n`) waits for it, then shares it instead of computing it
   again.

A long prompt is thus prefilled over several steps while decodes keep running, and several
prompts may share a step. Runs on the driver; the ranks only see the resulting plans.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from braid.engine.batch import StepResult
from braid.engine.grammar import accept_token
from braid.engine.kv_cache import BlockManager
from braid.engine.plan import SequenceRows
from braid.engine.request import Sequence, SequenceDelta, request_failure


class WaitingQueue:
    """Sequences waiting to run, in the order admission considers them (see the module
    docstring). Adding and removing a sequence are O(1), so aborting a request of many
    sequences costs what it holds."""

    def __init__(self) -> None:
        self._preempted: dict[Sequence, None] = {}  # insertion-ordered sets
        self._groups: dict[str, dict[Sequence, None]] = {}  # served longest ago first
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._preempted or seq in self._groups.get(seq.group, ())

    def add(self, seq: Sequence, preempted: bool = False) -> None:
        (self._preempted if preempted else self._groups.setdefault(seq.group, {}))[seq] = None
        self._count += 1

    def remove(self, seq: Sequence) -> None:
        """Take a waiting sequence out (admitted or aborted)."""
        if seq in self._preempted:
            del self._preempted[seq]
        else:
            group = self._groups[seq.group]
            del group[seq]
            if not group:
                del self._groups[seq.group]
        self._count -= 1

    def was_preempted(self, seq: Sequence) -> bool:
        return seq in self._preempted

    def served(self, seq: Sequence) -> None:
        """`seq`'s group had its turn: it goes to the back of the line."""
        if seq.group in self._groups:
            self._groups[seq.group] = self._groups.pop(seq.group)

    def in_turn(self) -> Iterator[Sequence]:
        """Candidates for admission: preempted sequences oldest first, then each group's first
        waiting sequence in turn, round after round. A group whose candidate is still waiting
        when the next is asked for (it did not fit) is passed over until the next step."""
        yield from sorted(self._preempted, key=lambda s: s.seq_id)
        passed: set[str] = set()
        while True:
            progressed = False
            for group in list(self._groups):
                seqs = self._groups.get(group)
                if group in passed or not seqs:
                    continue
                head = next(iter(seqs))
                yield head
                if head in seqs:
                    passed.add(group)
                else:
                    progressed = True
            if not progressed:
                return


class Scheduler:
    """Chooses each step's sequences and records what the step produced."""

    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int, max_running: int,
                 max_context: int, max_skip_age_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_running = max_running
        self.max_context = max_context
        self.max_skip_age_s = max_skip_age_s
        self.clock = clock  # for the skip age
        self.waiting = WaitingQueue()
        self.running: dict[Sequence, None] = {}  # an insertion-ordered set: oldest first
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0  # ... and found there

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """Drop a sequence now, wherever it is; its blocks are free at once."""
        if seq in self.running:
            del self.running[seq]
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finish_reason = "abort"

    def schedule(self) -> list[Sequence]:
        """The next step's sequences, in plan order, each with its `scheduled_tokens`
        (empty when nothing can run)."""
        for seq in self.running:
            seq.scheduled_tokens = 0
        batch: list[Sequence] = []
        budget = self.max_num_batched_tokens
        for seq in [s for s in self.running if s.num_tokens - s.num_computed == 1]:
            if budget == 0:
                break
            if seq.blocks and self._grow_or_preempt(seq):  # no blocks: preempted just now
                seq.scheduled_tokens = 1
                batch.append(seq)
                budget -= 1
        for seq in [s for s in self.running if s.num_tokens - s.num_computed > 1]:
            if budget == 0:
                break
            chunk = self._fitting_chunk(seq, budget)
            if chunk:
                seq.blocks += self.blocks.allocate(
                    self.blocks.blocks_needed(seq.num_computed + chunk, len(seq.blocks)))
                seq.scheduled_tokens = chunk
                batch.append(seq)
                budget -= chunk
        self._admit(batch, budget)
        return batch

    def _grow_or_preempt(self, seq: Sequence) -> bool:
        """Give a decoding sequence the block its next token needs, preempting the newest
        running sequences for it (possibly itself: then False)."""
        need = self.blocks.blocks_needed(seq.num_tokens, len(seq.blocks))
        while need > self.blocks.num_free:
            victim = next(reversed(self.running))
            self._preempt(victim)
            if victim is seq:
                return False
        seq.blocks += self.blocks.allocate(need)
        return True

    def _fitting_chunk(self, seq: Sequence, budget: int) -> int:
        """The most of a prompt's remaining tokens that the budget and free blocks allow."""
        room = (len(seq.blocks) + self.blocks.num_free) * self.blocks.block_size
        return max(0, min(seq.num_tokens - seq.num_computed, budget, room - seq.num_computed))

    def _fills_its_blocks(self, seq: Sequence) -> bool:
        """Whether this step fills the sequence's blocks exactly: its next token needs a new
        block."""
        return seq.num_computed + seq.scheduled_tokens == len(seq.blocks) * self.blocks.block_size

    def _admit(self, batch: list[Sequence], budget: int) -> None:
        """Admit waiting sequences while their first chunk fits (see the module docstring)."""
        bs = self.blocks.block_size
        reserve = sum(1 for s in self.running if self._fills_its_blocks(s))
        # Prefix blocks that prompts being prefilled (now or in this step) are computing.
        computing = {key for s in self.running if not s.prompt_done
                     for key in self.blocks.shareable_keys(s)}
        now = self.clock()
        for seq in self.waiting.in_turn():
            if budget == 0 or len(self.running) >= self.max_running:
                return
            keys = self.blocks.shareable_keys(seq)
            # Prompt logprobs need the logits of every prompt position: no cached prefix
            # (the blocks it computes are shared with others all the same).
            scoring = seq.scores_prompt and len(seq.prompt_logprobs) < len(seq.prompt_ids) - 1
            cached = 0 if scoring else self.blocks.cached_prefix(keys)
            if not scoring and cached < len(keys) and keys[cached] in computing:
                continue  # its next block is being computed: share it from a later step
            computed = cached * bs
            chunk = min(seq.num_tokens - computed, budget)
            need = self.blocks.blocks_needed(computed + chunk, cached)
            free = self.blocks.num_free - self.blocks.num_unreferenced(keys[:cached])
            if need + reserve + ((computed + chunk) % bs == 0) > free:
                if seq.skipped_since is None:
                    seq.skipped_since = now
                if self.waiting.was_preempted(seq) or now - seq.skipped_since > self.max_skip_age_s:
                    return  # preempted, or overtaken long enough: nothing overtakes it now
                continue
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += computed
            if not seq.output_ids:
                seq.num_cached_prompt = computed
            seq.blocks = self.blocks.share(keys[:cached]) + self.blocks.allocate(need)
            seq.num_computed = computed
            seq.num_registered_blocks = cached
            seq.scheduled_tokens = chunk
            seq.skipped_since = None
            self.waiting.remove(seq)
            self.waiting.served(seq)
            self.running[seq] = None
            batch.append(seq)
            budget -= chunk
            reserve += self._fills_its_blocks(seq)
            computing.update(keys)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        del self.running[seq]
        self._release(seq)
        self.waiting.add(seq, preempted=True)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.blocks)
        seq.blocks, seq.num_computed, seq.scheduled_tokens = [], 0, 0
        seq.num_registered_blocks = 0

    def commit(self, batch: list[Sequence], layout: list[SequenceRows],
               result: StepResult) -> list[SequenceDelta]:
        """Record a step's results; one delta per sequence that got a token or finished.

        A sequence whose step ended inside its prompt only records its prompt logprobs. A
        failure while recording one sequence's token fails that sequence alone.
        """
        deltas = []
        for seq, rows in zip(batch, layout):
            seq.num_computed += seq.scheduled_tokens
            seq.scheduled_tokens = 0
            try:
                self.blocks.register(seq)
                if rows.prompt_count:
                    seq.prompt_logprobs += result.prompt_logprobs[
                        rows.prompt_start:rows.prompt_start + rows.prompt_count]
                if rows.sample_row is not None:
                    deltas.append(self._record_token(seq, result, rows.sample_row))
            except AssertionError:
                raise  # the block manager's own invariants: the engine is broken, not a request
            except Exception as e:  # noqa: BLE001 - one sequence's failure is its own
                deltas.append(self.fail(seq, request_failure("recording its token", e)))
        return deltas

    def fail(self, seq: Sequence, error: str) -> SequenceDelta:
        """End a sequence with an error (its blocks are free at once); the delta saying so."""
        if not seq.finished:
            if seq in self.running or seq in self.waiting:
                self.abort(seq)
            seq.finish_reason = "error"
        return SequenceDelta(seq.request_id, seq.index, finish_reason="error", error=error)

    def _record_token(self, seq: Sequence, result: StepResult, row: int) -> SequenceDelta:
        delta = SequenceDelta(seq.request_id, seq.index)
        token = result.tokens[row]
        if token is None:
            return self.fail(seq, result.errors[row])
        seq.output_ids.append(token)
        delta.new_token_ids = [token]
        params = seq.params
        grammar_complete = seq.grammar is not None and accept_token(seq.grammar, token)
        if result.logprobs is not None:
            delta.logprobs = [result.logprobs[row]]
        if len(seq.output_ids) == 1:
            delta.num_prompt_tokens = len(seq.prompt_ids)
            delta.num_cached_tokens = seq.num_cached_prompt
            if seq.scores_prompt:
                delta.prompt_logprobs = seq.prompt_logprobs
        if len(seq.output_ids) >= params.min_tokens:
            if token in params.stop_token_ids:
                delta.finish_reason, delta.stop_reason = "stop", token
            elif not params.ignore_eos and token in seq.eos_token_ids:
                delta.finish_reason = "stop"
            delta.by_stop_token = delta.finish_reason is not None
        if delta.finish_reason is None and grammar_complete:  # nothing else may follow
            delta.finish_reason = "stop"
        if delta.finish_reason is None and (len(seq.output_ids) >= params.max_new_tokens
                                            or seq.num_tokens >= self.max_context):
            delta.finish_reason = "length"
        if delta.finish_reason is not None:
            self._finish(seq, delta.finish_reason)
        return delta

    def _finish(self, seq: Sequence, reason: str) -> None:
        del self.running[seq]
        self._release(seq)
        seq.finish_reason = reason
