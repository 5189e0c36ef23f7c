"""`--speculative mtp` on the ranks: after each step's forward, the model's multi-token-
prediction layer (`braid.models.deepseek_mtp`) runs over the step's rows and proposes one
token per sequence that sampled.

The layer reads, at each row, the model's final hidden state and the token that follows the
row's: the next input token within a prompt, the sampled token where the row sampled. The
sampled tokens are on rank 0 alone, so rank 0 sends them to the other ranks (one small
gather of integers) with the row each sequence proposes from: the last row of its accepted
draft, that is its first row whose sampled token differs from the draft's next token (or its
last row), where the sampled token is the one the sequence keeps. The driver's acceptance
rule (`Scheduler._record_tokens`) is the same, so the proposal follows the sequence's newest
token.

The layer's keys are written at the model's slots for the same positions: rows past a
rejected draft write keys that the next step overwrites, as it does the model's. The last row
of a prompt chunk that does not end the prompt has no next token in the step; its key reads
the next sequence's first token (or none), a flaw in one position of the draft's own cache,
never in the model's outputs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from braid.distributed.comm import Communicator
from braid.layers.forward_batch import ForwardBatch
from braid.models.deepseek_mtp import MultiTokenPredictor
from braid.overlap.operations import execute
from braid.step import StepPlan


def draft_inputs(plan: StepPlan, tokens: list[int | None]) -> tuple[np.ndarray, np.ndarray]:
    """Rank 0's part: each row's next token (`tokens`: the step's sampled tokens, by
    sampling row; None where sampling failed) and each sampling run's proposing row."""
    next_ids = np.append(plan.input_ids[1:], 0)
    sampled_rows = plan.logit_rows[plan.sample_rows]
    next_ids[sampled_rows] = [0 if token is None else token for token in tokens]
    proposing = np.empty(len(plan.sample_runs), dtype=np.int64)
    first = 0
    for run, count in enumerate(plan.sample_runs.tolist()):
        rows = sampled_rows[first:first + count]
        kept = 0  # the run's rows whose sampled token equals the draft's next
        while kept < count - 1 and next_ids[rows[kept]] == plan.input_ids[rows[kept] + 1]:
            kept += 1
        proposing[run] = rows[kept]
        first += count
    return next_ids, proposing


class MTPDraft:
    """One rank's MTP proposals (see the module docstring)."""

    def __init__(self, layer: MultiTokenPredictor, comm: Communicator, block_size: int,
                 device: torch.device) -> None:
        self.layer = layer
        self.comm = comm
        self.block_size = block_size
        self.device = device
        self.operations = layer.operations()

    def propose(self, plan: StepPlan, hidden: torch.Tensor,
                tokens: list[int | None] | None) -> list[int] | None:
        """Run the layer over the step's rows (`hidden`: the model's final hidden states;
        `tokens`: rank 0's sampled tokens, None on the others); rank 0 returns one proposal per
        sampling run, the others None. Every rank calls it after every step."""
        runs = 0 if plan.sample_runs is None else len(plan.sample_runs)
        if runs:
            shared = np.zeros(plan.num_tokens + runs, dtype=np.int64)
            if tokens is not None:
                shared = np.concatenate(draft_inputs(plan, tokens))
            gathered = self.comm.all_gather(torch.from_numpy(shared))
            next_ids, proposing = np.split(gathered[:len(shared)].numpy(), [plan.num_tokens])
        else:  # a prompt chunk: its next tokens are its own
            next_ids = np.append(plan.input_ids[1:], 0)
            proposing = np.zeros(0, dtype=np.int64)
        rows = dataclasses.replace(plan, input_ids=next_ids, logit_rows=proposing,
                                   pool_segments=None)
        logits = execute(self.operations, ForwardBatch(rows, self.block_size, self.device),
                         inputs={"previous": hidden})["logits"]
        if self.comm.rank != 0 or not runs:
            return None
        return logits.argmax(-1).tolist()
