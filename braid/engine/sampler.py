"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds."""

from __future__ import annotations

import torch

from braid.engine.batch import SamplingBatch

_SEED_STRIDE = 1_000_003  # distinct generator seed per (request seed, output position)


def sample(logits: torch.Tensor, params: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
    """Next token per row of `logits` ([B, vocab], fp32).

    Rows with temperature 0 take the argmax. A seeded row draws from a generator seeded by its
    seed and output position, so its tokens do not depend on what else is in the batch.
    """
    tokens = logits.argmax(dim=-1)
    temperatures = torch.from_numpy(params.temperatures).to(logits.device)
    sampled_rows = (temperatures > 0).nonzero().flatten().tolist()
    if not sampled_rows:
        return tokens
    rows = torch.tensor(sampled_rows, device=logits.device)
    probs = _filtered_probs(logits[rows] / temperatures[rows, None],
                            torch.from_numpy(params.top_ks)[sampled_rows].tolist(),
                            torch.from_numpy(params.top_ps)[sampled_rows].to(logits.device))
    for i, row in enumerate(sampled_rows):
        seed = params.seeds[row]
        gen = generator
        if seed is not None:
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(seed * _SEED_STRIDE + int(params.output_positions[row]))
        tokens[row] = torch.multinomial(probs[i], 1, generator=gen)[0]
    return tokens


def _filtered_probs(logits: torch.Tensor, top_ks: list[int], top_ps: torch.Tensor) -> torch.Tensor:
    """Softmax after masking tokens outside each row's top-k and top-p (nucleus) set."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    k = torch.tensor([kk if kk > 0 else logits.shape[-1] for kk in top_ks], device=logits.device)
    drop = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token crossing it is kept).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_ps[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)
