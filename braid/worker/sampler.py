"""What rank 0 does with a step's logits: sampling (greedy, temperature, top-k, top-p, min-p,
penalties, logit biases, grammar masks, per-request seeds) and logprobs. A row that cannot be
sampled (NaN logits, a failed draw, anything its own parameters make fail) fails alone: its
token is None and the error names the cause; the other rows, and the rank, go on."""

from __future__ import annotations

import numpy as np
import torch

from braid import native
from braid.errors import request_failure
from braid.step import NO_TOKEN_ALLOWED, Penalty, SamplingBatch, StepPlan, StepResult, TokenLogprob

_SEED_STRIDE = 1_000_003  # distinct generator seed per (request seed, output position)


def postprocess(logits: torch.Tensor, plan: StepPlan, generator: torch.Generator,
                grammar_mask: np.ndarray | None = None) -> StepResult:
    """Rank 0's answer to `plan` from the logits of its logit rows ([R, vocab], fp32), with
    the bitmask of its grammar rows where it has any (`SamplingBatch.grammar_rows`)."""
    result = StepResult(plan.step_id, logits=logits.cpu() if plan.return_logits else None)
    if plan.sampling is not None:
        rows = _select_rows(logits, plan.sample_rows)
        sampling = plan.sampling
        wants_logprobs = bool((sampling.num_logprobs >= 0).any() or any(sampling.scored_ids))
        # Nothing reads the raw logits after sampling: masks and penalties may overwrite them
        scratch = not (wants_logprobs or plan.return_logits
                       or plan.prompt_logprobs is not None)
        result.tokens, result.errors = sample(rows, sampling, generator, grammar_mask, scratch)
        if wants_logprobs:
            chosen = [t if t is not None else 0 for t in result.tokens]
            entries = token_logprobs(rows, chosen, sampling.num_logprobs, sampling.scored_ids,
                                     result.errors)
            for row in result.errors:
                result.tokens[row] = None
            result.logprobs = [None if token is None else entry
                               for token, entry in zip(result.tokens, entries)]
    if plan.prompt_logprobs is not None:
        wanted = plan.prompt_logprobs
        result.prompt_logprobs = token_logprobs(
            _select_rows(logits, wanted.rows), wanted.targets.tolist(),
            wanted.num_logprobs)
    return result


def _select_rows(logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """logits[rows], without a copy when that is every row in order (a decode step)."""
    if len(rows) == logits.shape[0] and np.array_equal(rows, np.arange(len(rows))):
        return logits
    return logits[torch.from_numpy(rows).to(logits.device)]


def token_logprobs(logits: torch.Tensor, chosen: list[int], num_logprobs,
                   scored_ids: list[tuple[int, ...]] | None = None,
                   errors: dict[int, str] | None = None) -> list[TokenLogprob | None]:
    """Per row: the chosen token's logprob, the top `num_logprobs[row]` alternatives and the
    logprobs of `scored_ids[row]` (None for a row that asks for neither: -1 and no ids). A row
    whose ids cannot be scored gets None and its reason in `errors`."""
    counts = [int(k) for k in num_logprobs]
    scored_ids = scored_ids or [()] * len(counts)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, torch.tensor(chosen, device=logits.device)[:, None])[:, 0]
    ranks = ((logprobs > picked[:, None]).sum(dim=-1) + 1).tolist()
    top_k = max(counts, default=0)
    top_values, top_ids = (logprobs.topk(top_k, dim=-1) if top_k > 0
                           else (logprobs[:, :0], logprobs[:, :0].long()))
    picked, top_values, top_ids = picked.tolist(), top_values.tolist(), top_ids.tolist()
    entries: list[TokenLogprob | None] = []
    for row, (k, ids) in enumerate(zip(counts, scored_ids)):
        if k < 0 and not ids:
            entries.append(None)
            continue
        top = tuple(zip(top_ids[row][:max(k, 0)], top_values[row][:max(k, 0)]))
        try:
            scored = tuple(zip(ids, logprobs[row, list(ids)].tolist())) if ids else ()
        except (IndexError, RuntimeError) as e:
            if errors is None:
                raise
            errors[row] = request_failure("scoring the requested token ids", e)
            entries.append(None)
            continue
        entries.append(TokenLogprob(chosen[row], picked[row], top, scored, ranks[row]))
    return entries


def sample(logits: torch.Tensor, params: SamplingBatch, generator: torch.Generator,
           grammar_mask: np.ndarray | None = None,
           scratch: bool = False) -> tuple[list[int | None], dict[int, str]]:
    """Next token per row of `logits` ([S, vocab], fp32), and the rows that failed.

    Rows with temperature 0 take the argmax. A seeded row draws from a generator seeded by its
    seed and output position, so its tokens do not depend on what else is in the batch.
    `grammar_mask`: the bitmask of `params.grammar_rows`; `scratch`: `logits` may be
    overwritten (else penalties, biases and masks apply to a copy).
    """
    logits, errors = _constrained(logits, params, grammar_mask, scratch)
    # The argmax picks a NaN where a row has one, so the chosen logits reveal the failed rows
    # without another pass over the vocabulary; -inf where nothing is allowed.
    chosen, tokens = _row_max(logits)
    for row in np.flatnonzero(np.isnan(chosen)).tolist():
        errors.setdefault(row, "the model produced NaN logits")
    for row in np.flatnonzero(np.isneginf(chosen)).tolist():
        errors.setdefault(row, NO_TOKEN_ALLOWED)
    sampled_rows = [r for r in np.flatnonzero(params.temperatures > 0).tolist()
                    if r not in errors]
    if sampled_rows:
        temperatures = torch.from_numpy(params.temperatures).to(logits.device)
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _filtered_probs(
            logits[rows] / temperatures[rows, None],
            torch.from_numpy(params.top_ks)[sampled_rows].tolist(),
            torch.from_numpy(params.top_ps)[sampled_rows].to(logits.device),
            torch.from_numpy(params.min_ps)[sampled_rows].to(logits.device))
        for i, row in enumerate(sampled_rows):
            seed = params.seeds[row]
            gen = generator
            if seed is not None:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed((seed * _SEED_STRIDE + int(params.output_positions[row]))
                                % (1 << 64))
            try:
                tokens[row] = draw(probs[i], gen)
            except ValueError as e:  # no token left with a finite probability
                errors[row] = f"sampling failed: {e}"
    out: list[int | None] = tokens.tolist()
    for row in errors:
        out[row] = None
    return out, errors


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn from one row of probabilities (not necessarily normalised): the first
    whose running sum exceeds a uniform draw times the total: a small fraction of
    torch.multinomial's time on CPU (docs/kernel-choices.md, "Sampling")."""
    cumulative = probs.cumsum(0, dtype=torch.float64)
    total = cumulative[-1].item()
    if not 0 < total < float("inf"):
        raise ValueError(f"the probabilities sum to {total}")
    u = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)
    token = int(torch.searchsorted(cumulative, u * total, right=True))
    # u * total rounds to the total at most: the last token with a positive probability
    return min(token, int(probs.nonzero()[-1])) if token >= len(probs) else token


def _row_max(logits: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Each row's greatest logit (numpy) and the index of its first occurrence; a row with
    a NaN gets its first NaN. On CPU through numpy's argmax, which is vectorised where
    torch's reductions with indices are not (several times faster: docs/kernel-choices.md,
    "Sampling")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        values = logits.numpy()
        tokens = values.argmax(axis=-1)
        return values[np.arange(len(tokens)), tokens], torch.from_numpy(tokens)
    # max with indices is the argmax (the first greatest), and faster than argmax
    chosen, tokens = logits.max(dim=-1)
    return chosen.float().cpu().numpy(), tokens


def _constrained(logits: torch.Tensor, params: SamplingBatch, grammar_mask: np.ndarray | None,
                 scratch: bool) -> tuple[torch.Tensor, dict[int, str]]:
    """Logits after each row's penalties, biases, banned tokens and grammar mask (a copy
    unless `scratch`, only if any apply), and the rows whose own parameters made that fail
    (their logits become NaN, so nothing is sampled from them)."""
    rows = [r for r in range(logits.shape[0])
            if params.penalties[r] or params.banned[r] or params.biases[r]]
    errors: dict[int, str] = {}
    if not rows and not len(params.grammar_rows):
        return logits, errors
    if not scratch:
        logits = logits.clone()
    if len(params.grammar_rows):
        apply_grammar_mask(logits, params.grammar_rows, grammar_mask)
    for row in rows:
        try:
            if params.penalties[row] is not None:
                _apply_penalty(logits[row], params.penalties[row])
            if params.biases[row]:
                ids, values = zip(*params.biases[row])
                logits[row, list(ids)] += torch.tensor(values, dtype=logits.dtype,
                                                       device=logits.device)
            if params.banned[row]:
                logits[row, list(params.banned[row])] = float("-inf")
        except (IndexError, RuntimeError, ValueError) as e:
            errors[row] = request_failure("applying its sampling parameters", e)
            logits[row] = float("nan")
    return logits, errors


def apply_grammar_mask(logits: torch.Tensor, rows: np.ndarray, mask: np.ndarray) -> None:
    """Set the tokens each grammar row's bitmask excludes to -inf, in place (bit t of a row's
    int32 words, least significant first, allows token t). On CPU braid's operator, which
    skips whole words of allowed tokens; elsewhere the unpacked mask (fast on a GPU)."""
    index = torch.from_numpy(rows)
    if (logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.is_contiguous() and native.load()):
        torch.ops.braid.apply_token_bitmask(logits, index, torch.from_numpy(mask))
        return
    allowed = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=1,
                            bitorder="little")[:, :logits.shape[1]]
    excluded = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    excluded[index.to(logits.device)] = torch.from_numpy(allowed == 0).to(logits.device)
    logits.masked_fill_(excluded, float("-inf"))


def _apply_penalty(logits: torch.Tensor, penalty: Penalty) -> None:
    """vLLM's (and OpenAI's) penalties, in place on one row: repetition divides positive and
    multiplies negative logits of every token seen in the prompt or output; presence and
    frequency subtract once, and once per occurrence, for tokens of the output."""
    device = logits.device
    if penalty.repetition != 1.0:
        seen = torch.from_numpy(penalty.prompt_ids).to(device)
        if len(penalty.output_ids):
            seen = torch.cat([seen, torch.from_numpy(penalty.output_ids).to(device)]).unique()
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / penalty.repetition,
                                   values * penalty.repetition)
    if len(penalty.output_ids) and (penalty.presence or penalty.frequency):
        counts = torch.bincount(torch.from_numpy(penalty.output_ids).to(device),
                                minlength=logits.shape[0]).to(logits.dtype)
        logits -= penalty.frequency * counts + penalty.presence * (counts > 0).to(logits.dtype)


def _filtered_probs(logits: torch.Tensor, top_ks: list[int], top_ps: torch.Tensor,
                    min_ps: torch.Tensor) -> torch.Tensor:
    """Softmax after masking tokens outside each row's top-k and top-p (nucleus) set and
    below min-p times the most likely token's probability. Rows without any of the three are
    a plain softmax: sorting the vocabulary of every row was most of a step's time when 32
    sequences sampled at temperature 1 (docs/performance.md, "Speculative decoding")."""
    vocab = logits.shape[-1]
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_ks], device=logits.device)
    filtered_rows = (k < vocab) | (top_ps < 1) | (min_ps > 0)
    if not filtered_rows.any():
        return logits.softmax(dim=-1)
    if not filtered_rows.all():
        probs = logits.softmax(dim=-1)
        rows = filtered_rows.nonzero()[:, 0]
        probs[rows] = _filtered_probs(logits[rows], [top_ks[i] for i in rows.tolist()],
                                      top_ps[rows], min_ps[rows])
        return probs
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    drop = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token crossing it is kept), and
    # always the most likely token (a top_p that is 0 in float32 keeps just that one).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_ps[:, None]
    drop[:, 0] = False
    drop |= probs < min_ps[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)
