"""`--speculative draft` on the ranks: a smaller model sharing the tokenizer, loaded beside the
model at the same tp, drafts each proposing sequence's tokens at the start of a step, and the
step's own forward verifies them (`braid.step.DraftPlan`).

The draft's KV cache has the model's blocks and block size and is written at the model's
slots: a sequence's blocks, the prefix cache and rollback after a rejected draft serve both
caches. Each step first runs the draft over its catch-up rows (the tokens it has not computed,
up to each sequence's last one: the argmax there is the first proposal), then one decode step
per further proposed token, each at the position and slot of the model's verification row
that token is placed on, so the draft writes keys only where the model writes them in the same
step; keys of rejected proposals are overwritten as the model's are. Rank 0 alone has the
logits, so every proposal reaches the other ranks through one small all-gather per draft step.
The draft's steps are compiled where the model's are (its decode graphs and pieces, prepared
after the model's).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from braid.config import EngineConfig
from braid.distributed.comm import Communicator
from braid.loader.model_config import load_model_config
from braid.step import DraftPlan, StepPlan


def draft_engine(engine: EngineConfig) -> EngineConfig:
    """The draft model's settings: the model's, without speculation (so a model drafting for
    itself shares the saved decode graphs of its plain launches)."""
    return engine.replace(model=engine.speculative.draft_model, speculative="off",
                          draft_model=None)


class RankDraft:
    """One rank's shard of the draft model and its KV cache (see the module docstring)."""

    def __init__(self, engine: EngineConfig, comm: Communicator) -> None:
        from braid.worker.model_runner import ModelRunner  # which holds this class

        draft = draft_engine(engine)
        self.runner = ModelRunner(draft, load_model_config(draft.model, draft.cache), comm)
        self.comm = comm

    def fill(self, plan: StepPlan) -> tuple[list[list[int]], list[float]]:
        """Write the draft's proposals into `plan.input_ids` (the rows after each proposing
        sequence's last token) and return them, by proposing sequence, with the seconds of
        each of the draft's forwards (the catch-up's first; `DraftPlan.forward_rows`)."""
        draft: DraftPlan = plan.draft
        # The attention row of each of the step's tokens, for the block table it reads
        attention_row = np.repeat(np.arange(len(plan.q_lens)), plan.q_lens)
        start = time.perf_counter()
        newest = self._greedy(draft.catch_up, draft.proposers)  # each one's first proposal
        seconds = [time.perf_counter() - start]
        for depth in range(1, int(draft.lengths.max(initial=0)) + 1):
            going = draft.lengths >= depth  # the sequences whose proposal `depth` is `newest`
            plan.input_ids[draft.rows[going] + depth] = newest[going]
            more = draft.lengths > depth  # ... and which propose one more after it
            if more.any():
                start = time.perf_counter()
                rows = draft.rows[more] + depth  # where that proposal is, and its key goes
                positions = plan.positions[rows]
                newest[more] = self._greedy(StepPlan(
                    plan.input_ids[rows], positions, plan.slot_mapping[rows],
                    np.ones(len(rows), dtype=np.int64), positions + 1,
                    plan.block_tables[attention_row[rows]]))
                seconds.append(time.perf_counter() - start)
        drafts = [plan.input_ids[row + 1:row + 1 + k].tolist()
                  for row, k in zip(draft.rows.tolist(), draft.lengths.tolist())]
        return drafts, seconds

    def _greedy(self, plan: StepPlan, rows: np.ndarray | None = None) -> np.ndarray:
        """The draft's argmax at `rows` of the plan's logits (None: all; a plan with every
        token a logit row, one decode row each, runs the draft's decode graph), on every
        rank."""
        logits = self.runner.logits(plan)
        count = plan.num_tokens if rows is None else len(rows)
        local = torch.zeros(count, dtype=torch.int64)
        if self.comm.rank == 0:
            local = (logits if rows is None else logits[torch.from_numpy(rows)]).argmax(-1)
        if self.comm.world_size == 1:
            return local.numpy()
        return self.comm.all_gather(local)[:count].numpy().copy()  # (a view of shared memory)
