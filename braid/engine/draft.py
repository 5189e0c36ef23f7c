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

The draft's keys live at the model's slots, so this side tracks, per sequence, how many of its
leading positions hold the draft's keys: the catch-up starts there (never past the model's own
computed tokens: a rejected proposal's key, a preempted sequence) and computes up to the step's
last token of the sequence; a proposal of k tokens then writes the keys of the first k - 1 at
the positions the model verifies them at. A sequence first planned with a cached prefix trusts
the draft's keys in those blocks: they were written with the model's, but for the last token or
two its sequence accepted if it ended there (a flaw in the draft's proposals, never in the
outputs, which the model verifies).
"""

from __future__ import annotations

import numpy as np

from braid.config import EngineConfig
from braid.engine.plan import slot_mapping
from braid.engine.request import Sequence
from braid.errors import UserError
from braid.loader.model_config import ModelConfig, load_model_config
from braid.models.registry import model_class
from braid.step import DraftPlan, StepPlan, StepResult

PLACEHOLDER = 0  # a proposal's token until the ranks' draft fills it in


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
    docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._computed: dict[int, int] = {}  # seq_id -> leading positions with draft keys

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [[] if seq.params.penalized else [PLACEHOLDER] * k for seq, k in zip(seqs, ks)]

    def plan(self, batch: list[Sequence], live: set[int]) -> DraftPlan | None:
        """The draft's part of the step of `batch` (`live`: the ids of the sequences still
        running, whose draft positions are kept); None where no sequence generates.

        A decoding sequence's catch-up (its newest token, and those accepted since the draft
        last computed) is one attention row per token, as a verification is, and then every
        row is a logit row: a step of decoding sequences alone is decode-shaped, which the
        draft's decode graph runs."""
        self._computed = {s: n for s, n in self._computed.items() if s in live}
        attention: list[tuple[Sequence, int, int]] = []  # (sequence, first position, end)
        last_tokens, rows, lengths = [], [], []  # of the sequences that propose
        first_row = 0  # of the sequence in the step's plan
        for seq in batch:
            k = len(seq.draft)
            end = seq.num_computed + seq.scheduled_tokens - k  # its last token's position + 1
            if seq.params.pooling is None:
                start = min(self._computed.get(seq.seq_id, seq.num_computed), seq.num_computed)
                if seq.prompt_done:
                    attention += [(seq, p, p + 1) for p in range(start, end)]
                else:
                    attention.append((seq, start, end))
                self._computed[seq.seq_id] = end + max(k - 1, 0)
                if k:
                    last_tokens.append(sum(e - s for _, s, e in attention) - 1)
                    rows.append(first_row + end - 1 - seq.num_computed)
                    lengths.append(k)
            first_row += seq.scheduled_tokens
        if not attention:
            return None
        q_lens = np.array([end - start for _, start, end in attention], dtype=np.int64)
        positions = np.concatenate([np.arange(start, end) for _, start, end in attention]
                                   ).astype(np.int64)
        tables = np.zeros((len(attention), max(len(s.blocks) for s, _, _ in attention)),
                          dtype=np.int64)
        for i, (seq, _, _) in enumerate(attention):
            tables[i, :len(seq.blocks)] = seq.blocks
        input_ids = np.array([t for seq, start, end in attention
                              for t in seq.token_slice(start, end)], dtype=np.int64)
        last_tokens = np.array(last_tokens, dtype=np.int64)
        decode_shaped = bool((q_lens == 1).all())
        catch_up = StepPlan(input_ids, positions,
                            slot_mapping(tables, q_lens, positions, self.block_size), q_lens,
                            np.array([end for _, _, end in attention], dtype=np.int64), tables,
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
