"""`--speculative draft`: a small model sharing the target's tokenizer proposes each
sequence's next tokens, greedily, in the engine's own process.

The draft is a `ModelRunner` of one rank (any model braid loads, at the target's dtype; loaded
by name, as the engine imports no rank code) with a paged KV cache of its own, as large as the
target's, whose blocks this proposer allocates per sequence (`BlockManager`, no prefix cache).
Before a step it catches each decoding sequence's cache up with the tokens it has not seen (the
prompt at first, then the accepted tokens and the target's last one) in one batched forward
whose last row proposes the first token, then runs one batched decode step per further token.
The keys it wrote for its own proposals stay valid as far as the target accepted them; the rest
are overwritten by the next catch-up. A sequence that stops decoding (finished, preempted) gives
its blocks back at the next proposal.

Greedy proposals are point masses, so the target's acceptance rule (`Scheduler._record_tokens`)
keeps the output distribution exactly the target's, at any temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from braid.config import EngineConfig
from braid.distributed.comm import SkipCommunicator
from braid.engine.executor import MODEL_RUNNER
from braid.engine.kv_cache import BlockManager
from braid.engine.plan import slot_mapping
from braid.engine.request import Sequence
from braid.errors import UserError
from braid.loader.model_config import ModelConfig, load_model_config
from braid.spawn import resolve
from braid.step import StepPlan


@dataclass
class DraftCache:
    """A sequence's blocks in the draft's cache and how many of its leading positions hold
    keys (the last proposal's included, accepted or not)."""

    blocks: list[int] = field(default_factory=list)
    computed: int = 0


class DraftProposer:
    """Greedy proposals of a draft model (see the module docstring)."""

    def __init__(self, config: EngineConfig, target: ModelConfig) -> None:
        draft_config = load_model_config(config.speculative.draft_model, config.cache)
        if draft_config.vocab_size != target.vocab_size:
            raise UserError(f"--draft-model {config.speculative.draft_model} has a vocabulary of "
                            f"{draft_config.vocab_size} tokens, the model {target.vocab_size}: "
                            "a draft must share the model's tokenizer")
        # One rank, eager, with the target's precision and cache size, proposing nothing
        self.engine = config.replace(model=config.speculative.draft_model, tp=1, compile="off",
                                     speculative="off", draft_model=None, prefix_caching=False)
        self.runner = resolve(MODEL_RUNNER)(self.engine, draft_config, SkipCommunicator(0, 1))
        self.blocks = BlockManager(self.engine.kv_cache)
        self._caches: dict[int, DraftCache] = {}  # by seq_id

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        self._forget_all_but(seqs)
        active = []
        for seq, k in zip(seqs, ks):
            cache = self._caches.setdefault(seq.seq_id, DraftCache())
            # The keys of its last proposal hold as far as the target accepted it: up to the
            # token before the target's own last one
            cache.computed = min(cache.computed, seq.num_tokens - 1)
            # This proposal writes keys up to its (k - 1)th token
            need = self.blocks.blocks_needed(seq.num_tokens + k - 1, len(cache.blocks))
            if k and need <= self.blocks.num_free:
                cache.blocks += self.blocks.allocate(need)
                active.append((seq, k, cache))
        drafts = {seq.seq_id: [] for seq in seqs}
        self._catch_up(active, drafts)
        for depth in range(1, max((k for _, k, _ in active), default=0)):
            self._decode([(seq, cache) for seq, k, cache in active if k > depth], drafts)
        return [drafts[seq.seq_id] for seq in seqs]

    def _forget_all_but(self, seqs: list[Sequence]) -> None:
        """Free the caches of sequences no longer decoding (finished or preempted)."""
        keep = {seq.seq_id for seq in seqs}
        for seq_id in [s for s in self._caches if s not in keep]:
            self.blocks.free(self._caches.pop(seq_id).blocks)

    def _catch_up(self, active: list, drafts: dict[int, list[int]]) -> None:
        """Each sequence's tokens the draft has not computed, its last one proposing, in
        forwards of at most `--max-num-batched-tokens` tokens, as the target's steps (a
        prompt longer than that is computed over several)."""
        budget = self.engine.scheduler.max_num_batched_tokens
        behind = [(seq, seq.token_slice(cache.computed, seq.num_tokens), cache)
                  for seq, _, cache in active]
        while behind:
            rows, proposers, rest = [], [], []  # proposers: the row's sequence where it ends
            room = budget                       # its catch-up (its argmax is a proposal)
            for seq, tokens, cache in behind:
                piece = tokens[:room]
                if len(piece):
                    rows.append((piece, cache.computed, cache))
                    proposers.append(seq if len(piece) == len(tokens) else None)
                    room -= len(piece)
                if len(piece) < len(tokens):
                    rest.append((seq, tokens[len(piece):], cache))
            for seq, token in zip(proposers, self._run(rows)):
                if seq is not None:
                    drafts[seq.seq_id].append(token)
            behind = rest

    def _decode(self, group: list[tuple[Sequence, DraftCache]],
                drafts: dict[int, list[int]]) -> None:
        """One more proposed token for each sequence of `group`."""
        rows = [([drafts[seq.seq_id][-1]], cache.computed, cache) for seq, cache in group]
        for (seq, _), token in zip(group, self._run(rows)):
            drafts[seq.seq_id].append(token)

    def _run(self, rows: list[tuple[list[int], int, DraftCache]]) -> list[int]:
        """One draft step: each row's tokens from position `start` on (its cache then holds
        keys that far); the argmax at each row's last token."""
        if not rows:
            return []
        bs = self.engine.kv_cache.block_size
        q_lens = np.array([len(tokens) for tokens, _, _ in rows], dtype=np.int64)
        positions = np.concatenate([np.arange(start, start + len(tokens))
                                    for tokens, start, _ in rows])
        tables = np.zeros((len(rows), max(len(c.blocks) for _, _, c in rows)), dtype=np.int64)
        for i, (_, _, cache) in enumerate(rows):
            tables[i, :len(cache.blocks)] = cache.blocks
        plan = StepPlan(np.concatenate([tokens for tokens, _, _ in rows]).astype(np.int64),
                        positions.astype(np.int64),
                        slot_mapping(tables, q_lens, positions, bs).astype(np.int64), q_lens,
                        positions[np.cumsum(q_lens) - 1] + 1, tables,
                        logit_rows=np.cumsum(q_lens) - 1)
        logits = self.runner.logits(plan)
        for tokens, start, cache in rows:
            cache.computed = start + len(tokens)
        return logits.argmax(-1).tolist()
