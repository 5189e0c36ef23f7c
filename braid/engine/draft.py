"""`--speculative draft` on the driver: which sequences the ranks' draft model proposes for,
how many tokens, and what its catch-up computes (`braid.step.DraftPlan`; the ranks' part is
`braid.worker.draft`).

Before a step the `Speculator` asks this proposer for drafts of chosen lengths: it answers with
placeholders of those lengths, which the scheduler and the plan treat as any draft (rows,
blocks, sampling rows), and which the ranks replace by the draft's greedy tokens before the
model's forward; the step's answer brings them back (`StepResult.drafts`) to be accepted
(`Scheduler._record_tokens`) as any draft. Greedy proposals are point masses, so the
acceptance rule keeps the output distribution exactly the model's, at any temperature.

A sequence whose sampling reads its token history (penalties) proposes nothing: its
verification rows' penalties would have to count proposals that the driver learns only after
the step.

The draft computes only for the sequences that propose (so a step that proposes nothing costs
the draft nothing): a proposing sequence's catch-up is every token since the draft last
computed it, up to its newest (its whole prompt and output, the first time), whose argmax is
the first proposal. Where that does not fit the step's budget (`--max-num-batched-tokens`,
shared by the step's catch-ups) the sequence proposes nothing this step and catches up a chunk.
The draft's keys live at the model's slots, so this side tracks, per sequence, how many of its
leading positions hold them: the catch-up starts there (never past the model's own computed
tokens: a rejected proposal's key, a preempted sequence), and a proposal of k tokens then
writes the keys of the first k - 1 at the positions the model verifies them at.
"""

from __future__ import annotations

import numpy as np

from braid.config import EngineConfig
from braid.engine.plan import attention_layout
from braid.engine.request import Sequence
from braid.errors import UserError
from braid.loader.model_config import ModelConfig, load_model_config
from braid.models.registry import model_class
from braid.step import DraftPlan, StepPlan, StepResult

PLACEHOLDER = 0  # a proposal's token until the ranks' draft fills it in
# Catch-ups of at most this many tokens run as one decode row per token (see `plan`)
DECODE_SHAPED_CATCH_UP = 4


def check_draft_model(config: EngineConfig, target: ModelConfig) -> None:
    """Refuse, before the ranks start, a draft model that cannot draft for the model: another
    vocabulary, a shorter context, or heads that do not split at the model's tp."""
    path = config.speculative.draft_model
    draft = load_model_config(path, config.cache)
    if draft.vocab_size != target.vocab_size:
        raise UserError(f"--draft-model {path} has a vocabulary of {draft.vocab_size} tokens, "
                        f"the model {target.vocab_size}: a draft must share the model's "
                        "tokenizer")
    if draft.max_position_embeddings < target.max_position_embeddings:
        raise UserError(f"--draft-model {path} has a context of {draft.max_position_embeddings} "
                        f"tokens, the model {target.max_position_embeddings}: a draft must cover "
                        "the model's context")
    model_class(draft).check_config(draft, config.parallel.tp)


class RankDraftProposer:
    """Draft lengths for the ranks' draft model and each step's `DraftPlan` (see the module
    docstring). `budget`: the most tokens a step's catch-up computes."""

    def __init__(self, block_size: int, budget: int) -> None:
        self.block_size = block_size
        self.budget = budget
        self._computed: dict[int, int] = {}  # seq_id -> leading positions with draft keys
        self._chunks: dict[int, int] = {}  # seq_id -> tokens it catches up this step, unasked

    def _first_uncomputed(self, seq: Sequence) -> int:
        """The sequence's first position without the draft's key (never past the model's
        computed tokens: a rejected proposal's key, a preempted sequence)."""
        return min(self._computed.get(seq.seq_id, 0), seq.num_computed)

    def behind(self, seq: Sequence) -> int:
        """The sequence's tokens the draft has not computed: its catch-up were it to propose."""
        return seq.num_tokens - self._first_uncomputed(seq)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Placeholders of the asked lengths where the sequence's catch-up fits what is left
        of the step's budget; a sequence further behind proposes nothing and catches up a
        chunk of it instead."""
        self._chunks = {}
        room = self.budget
        drafts: list[list[int]] = []
        for seq, k in zip(seqs, ks):
            if not k or seq.params.penalized:
                drafts.append([])
                continue
            behind = self.behind(seq)
            if behind <= room:
                drafts.append([PLACEHOLDER] * k)
            else:
                drafts.append([])
                if room:
                    self._chunks[seq.seq_id] = room
            room -= min(behind, room)
        return drafts

    def plan(self, batch: list[Sequence], live: set[int]) -> DraftPlan | None:
        """The draft's part of the step of `batch` (`live`: the ids of the sequences still
        running, whose draft positions are kept); None where the draft has nothing to do.

        A catch-up of a few tokens (a decoding sequence's newest, and those accepted since) is
        one attention row per token, as a verification is, and then every row is a logit row:
        a step of such catch-ups alone is decode-shaped, which the draft's decode graph runs."""
        self._computed = {s: n for s, n in self._computed.items() if s in live}
        attention: list[tuple[Sequence, int, int]] = []  # (sequence, first position, end)
        last_tokens, rows, lengths = [], [], []  # of the sequences that propose
        first_row = 0  # of the sequence in the step's plan
        catch_up_tokens = 0
        for seq in batch:
            k, chunk = len(seq.draft), self._chunks.get(seq.seq_id, 0)
            if k or chunk:
                start = self._first_uncomputed(seq)
                end = seq.num_tokens if k else min(start + chunk, seq.num_tokens)
                if end - start <= DECODE_SHAPED_CATCH_UP:
                    attention += [(seq, p, p + 1) for p in range(start, end)]
                else:
                    attention.append((seq, start, end))
                catch_up_tokens += end - start
                self._computed[seq.seq_id] = end + max(k - 1, 0)
            if k:
                last_tokens.append(catch_up_tokens - 1)
                rows.append(first_row + seq.scheduled_tokens - k - 1)
                lengths.append(k)
            first_row += seq.scheduled_tokens
        if not attention:
            return None
        q_lens, kv_lens, positions, tables, slots = attention_layout(attention, self.block_size)
        input_ids = np.array([t for seq, start, end in attention
                              for t in seq.token_slice(start, end)], dtype=np.int64)
        last_tokens = np.array(last_tokens, dtype=np.int64)
        decode_shaped = bool((q_lens == 1).all())
        catch_up = StepPlan(input_ids, positions, slots, q_lens, kv_lens, tables,
                            logit_rows=None if decode_shaped else last_tokens)
        proposers = last_tokens if decode_shaped else np.arange(len(last_tokens))
        return DraftPlan(catch_up, proposers, np.array(rows, dtype=np.int64),
                         np.array(lengths, dtype=np.int64))

    @staticmethod
    def receive(batch: list[Sequence], result: StepResult) -> None:
        """Each proposing sequence's real draft, from the step's answer (before the commit
        accepts from it)."""
        for seq, draft in zip([seq for seq in batch if seq.draft], result.drafts or []):
            seq.draft = draft
