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

A decoding sequence may carry a draft (`Sequence.draft`, speculative decoding): it is
scheduled with 1 + len(draft) tokens where the budget and free blocks allow (a draft never
preempts anyone: it is cut to fit), and after the step only the accepted part of it stays. The
keys of rejected tokens are left behind in slots the sequence overwrites later, the blocks past
its tokens go back, and the prefix cache registers only blocks of accepted tokens.

A long prompt is thus prefilled over several steps while decodes keep running, and several
prompts may share a step. Runs on the driver; the ranks only see the resulting plans.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from braid.config import SchedulerConfig
from braid.engine.grammar import accept_token
from braid.engine.kv_cache import BlockManager
from braid.engine.plan import SequenceRows
from braid.engine.request import Sequence
from braid.errors import UserError, request_failure
from braid.step import NO_TOKEN_ALLOWED, SequenceDelta, StepResult


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

    def __init__(self, blocks: BlockManager, config: SchedulerConfig, max_context: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.blocks = blocks
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_running = config.max_running_requests
        self.max_context = max_context
        self.max_skip_age_s = config.max_skip_age_s
        self.clock = clock  # for the skip age
        self.waiting = WaitingQueue()
        self.running: dict[Sequence, None] = {}  # an insertion-ordered set: oldest first
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0  # ... and found there
        self.num_draft_tokens = 0  # proposed tokens verified by a step (speculative decoding)
        self.num_accepted_tokens = 0  # ... and accepted

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

    def decoding(self) -> list[Sequence]:
        """Running sequences whose prompt is done: each next step computes their newest
        token (and verifies their draft), oldest first."""
        return [s for s in self.running if s.num_tokens - s.num_computed == 1]

    def schedule(self) -> list[Sequence]:
        """The next step's sequences, in plan order, each with its `scheduled_tokens`
        (empty when nothing can run)."""
        for seq in self.running:
            seq.scheduled_tokens = 0
        batch: list[Sequence] = []
        budget = self.max_num_batched_tokens
        decoding = self.decoding()
        for i, seq in enumerate(decoding):
            if budget == 0:
                break
            del seq.draft[budget - 1:]
            if seq.blocks and self._grow_or_preempt(seq, len(decoding) - i - 1):
                seq.scheduled_tokens = 1 + len(seq.draft)  # no blocks: preempted just now
                batch.append(seq)
                budget -= seq.scheduled_tokens
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

    def _grow_or_preempt(self, seq: Sequence, decoding_after: int) -> bool:
        """Give a decoding sequence the block its next token needs, preempting the newest
        running sequences for it (possibly itself: then False), and blocks for as much of its
        draft as fits while a block stays free for each of the `decoding_after` sequences
        that decode after it in this step."""
        need = self.blocks.blocks_needed(seq.num_tokens, len(seq.blocks))
        while need > self.blocks.num_free:
            victim = next(reversed(self.running))
            self._preempt(victim)
            if victim is seq:
                return False
        spare = max(0, self.blocks.num_free - need - decoding_after)
        room = (len(seq.blocks) + need + spare) * self.blocks.block_size - seq.num_tokens
        del seq.draft[room:]
        seq.blocks += self.blocks.allocate(
            self.blocks.blocks_needed(seq.num_tokens + len(seq.draft), len(seq.blocks)))
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
            # Prompt logprobs and mean embeddings need every prompt position: no cached
            # prefix (the blocks it computes are shared with others all the same).
            scoring = seq.needs_every_position
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
        seq.draft = []
        seq.pooled = None  # a preempted embedding pools its recomputed prompt again

    def commit(self, batch: list[Sequence], layout: list[SequenceRows],
               result: StepResult) -> list[SequenceDelta]:
        """Record a step's results; one delta per sequence that got tokens or finished.

        A sequence whose step ended inside its prompt only records its prompt logprobs; one
        that verified a draft keeps the accepted tokens and one more (see `_record_tokens`).
        A failure while recording one sequence's tokens fails that sequence alone.
        """
        deltas = []
        for seq, rows in zip(batch, layout):
            computed = seq.num_computed + seq.scheduled_tokens
            seq.scheduled_tokens = 0
            try:
                if rows.prompt_count:
                    seq.prompt_logprobs += result.prompt_logprobs[
                        rows.prompt_start:rows.prompt_start + rows.prompt_count]
                if rows.pool_row is not None:
                    pooled = result.pooled[rows.pool_row]
                    seq.pooled = pooled if seq.pooled is None else seq.pooled + pooled
                    if rows.pool_final:
                        deltas.append(self._embedded(seq))
                        continue
                delta = None
                if rows.sample_row is not None:
                    delta = self._record_tokens(seq, result, rows)
                    deltas.append(delta)
                if seq.finished:  # failed while sampling
                    continue
                # The keys of the tokens before the newest are computed: a rejected draft's
                # are not, and its slots are overwritten by the tokens that follow.
                seq.num_computed = min(computed, seq.num_tokens - 1)
                self.blocks.register(seq)
                if seq.draft:  # blocks past its tokens go back
                    keep = self.blocks.blocks_needed(seq.num_tokens, 0)
                    self.blocks.free(seq.blocks[keep:])
                    del seq.blocks[keep:]
                    seq.draft = []
                if delta is not None and delta.finish_reason is not None:
                    self._finish(seq, delta.finish_reason)
            except AssertionError:
                raise  # the block manager's own invariants: the engine is broken, not a request
            except UserError as e:  # what the request asks cannot be generated: a 400
                deltas.append(self.fail(seq, str(e), invalid=True, param=e.param))
            except Exception as e:  # noqa: BLE001 - one sequence's failure is its own
                deltas.append(self.fail(seq, request_failure("recording its token", e)))
        return deltas

    def _embedded(self, seq: Sequence) -> SequenceDelta:
        """End an embedding whose whole prompt is pooled: its delta carries the vector."""
        count = len(seq.prompt_ids) if seq.params.pooling == "mean" else 1
        embedding = seq.pooled / count
        cached = seq.num_cached_prompt
        self._finish(seq, "stop")
        return SequenceDelta(seq.request_id, seq.index, finish_reason="stop",
                             embedding=embedding, num_prompt_tokens=len(seq.prompt_ids),
                             num_cached_tokens=cached)

    def fail(self, seq: Sequence, error: str, invalid: bool = False,
             param: str | None = None) -> SequenceDelta:
        """End a sequence with an error (its blocks are free at once); the delta saying so,
        `invalid` where the request's own constraints caused it (`param`: the field at fault,
        where one is)."""
        if not seq.finished:
            if seq in self.running or seq in self.waiting:
                self.abort(seq)
            seq.finish_reason = "error"
        return SequenceDelta(seq.request_id, seq.index, finish_reason="error", error=error,
                             invalid=invalid, param=param)

    def _record_tokens(self, seq: Sequence, result: StepResult,
                       rows: SequenceRows) -> SequenceDelta:
        """Append the step's tokens for `seq` (its finish, if one of them ends it, is left to
        the caller): row j's token follows the first j tokens of the draft, so rows are taken
        while each token equals the draft's next one, and the first that differs (or the row
        after the whole draft) is the last token taken.

        This is speculative decoding's acceptance rule, exact for a draft of proposed tokens
        (each a point mass): with q(d) = 1, accepting d with probability min(1, p(d) / q(d))
        and otherwise sampling from the residual max(0, p - q), normalised, draws from p, as
        a token sampled from p and kept only if it is d does. Each row's token is sampled
        from the target model's p as in plain decoding (its seed, penalties and `min_tokens`
        count the draft tokens before it), so greedy and seeded outputs are those of plain
        decoding."""
        delta = SequenceDelta(seq.request_id, seq.index)
        params = seq.params
        proposed = len(seq.draft)
        self.num_draft_tokens += proposed
        for j in range(rows.num_sample_rows):
            row = rows.sample_row + j
            token = result.tokens[row]
            if token is None:
                error = result.errors[row]
                return self.fail(seq, error, invalid=error == NO_TOKEN_ALLOWED)
            if seq.grammar is not None and accept_token(seq.grammar, token,
                                                        params.structured.source):
                delta.finish_reason = "stop"  # a complete grammar: nothing else may follow
                if (count := len(seq.output_ids) + 1) < params.min_tokens:
                    raise UserError(
                        f"min_tokens: the {params.structured.source} constraint is complete "
                        f"after {count} token{'s' * (count > 1)} and allows no more, but "
                        f"min_tokens asks for {params.min_tokens}", "min_tokens")
            seq.output_ids.append(token)
            delta.new_token_ids.append(token)
            if result.logprobs is not None:
                delta.logprobs = (delta.logprobs or []) + [result.logprobs[row]]
            if len(seq.output_ids) >= params.min_tokens:
                if token in params.stop_token_ids:
                    delta.finish_reason, delta.stop_reason = "stop", token
                    delta.by_stop_token = True
                elif not params.ignore_eos and token in seq.eos_token_ids:
                    delta.finish_reason, delta.stop_reason = "stop", None
                    delta.by_stop_token = True
            if delta.finish_reason is None and (len(seq.output_ids) >= params.max_new_tokens
                                                or seq.num_tokens >= self.max_context):
                delta.finish_reason = "length"
            if delta.finish_reason is not None or j == proposed or token != seq.draft[j]:
                break
            self.num_accepted_tokens += 1
        if len(seq.output_ids) == len(delta.new_token_ids):
            delta.num_prompt_tokens = len(seq.prompt_ids)
            delta.num_cached_tokens = seq.num_cached_prompt
            if seq.scores_prompt:
                delta.prompt_logprobs = seq.prompt_logprobs
        return delta

    def _finish(self, seq: Sequence, reason: str) -> None:
        del self.running[seq]
        self._release(seq)
        seq.finish_reason = reason
