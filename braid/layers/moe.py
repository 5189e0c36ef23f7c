"""Mixture of experts (DeepSeek-V2/V3, Qwen3-MoE, Mixtral): the router and tensor-parallel
routed experts.

Routed experts are split over ranks along their intermediate dimension, like a dense MLP: each
rank holds every expert's gate/up columns and down rows for its slice, computes a partial
output for every routed token, and the caller sums the partials over ranks (one all-reduce,
together with the shared experts'). Every rank routes the same tokens the same way: the router
is replicated and sees bitwise-identical hidden states.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from braid.distributed.comm import Communicator
from braid.errors import UserError
from braid.layers.linear import ReplicatedLinear, _copy_checked, _param
from braid.layers.partition import split_range
from braid.loader.weights import LazyWeight


@dataclass(frozen=True)
class RouterConfig:
    """How tokens pick experts, as a DeepSeek config says.

    `scoring`: "softmax" (V2) or "sigmoid" (V3, with a learned correction bias that steers
    the choice but not the weights). `method`: "greedy" (top-k of all experts),
    "group_limited_greedy" (V2: top-k within the `topk_group` groups of highest max score) or
    "noaux_tc" (V3: groups ranked by the sum of their two best biased scores).
    """

    num_experts: int
    top_k: int
    scoring: str
    method: str
    num_groups: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # V2's reference code either renormalises or scales; V3's renormalises, then scales.
    scale_after_norm: bool

    @staticmethod
    def softmax_top_k(num_experts: int, top_k: int, renormalize: bool) -> RouterConfig:
        """Softmax over all experts, the top k kept, renormalised to sum to one or not
        (Qwen3-MoE's `norm_topk_prob`; Mixtral always): the same as a softmax over the top k
        logits when renormalised, whatever k (`scale_after_norm` with a factor of 1 is the
        rule that renormalises even one expert)."""
        return RouterConfig(num_experts=num_experts, top_k=top_k, scoring="softmax",
                            method="greedy", num_groups=1, topk_group=1,
                            norm_topk_prob=renormalize, routed_scaling_factor=1.0,
                            scale_after_norm=renormalize)

    @staticmethod
    def from_hf(cfg: dict, v3: bool) -> RouterConfig:
        scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
        method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if scoring not in ("softmax", "sigmoid"):
            raise UserError(f"MoE scoring function {scoring!r} is not supported")
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise UserError(f"MoE top-k method {method!r} is not supported")
        config = RouterConfig(
            num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
            scoring=scoring, method=method, num_groups=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            scale_after_norm=v3)
        if config.num_experts % config.num_groups:
            raise UserError(f"{config.num_experts} experts do not split into "
                            f"{config.num_groups} groups")
        return config


class TopKRouter(nn.Module):
    """Replicated fp32 gate: hidden states -> (weights [T, k] fp32, expert ids [T, k])."""

    def __init__(self, hidden_size: int, config: RouterConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = _param(config.num_experts, hidden_size, dtype=torch.float32)
        self.weight.weight_loader = ReplicatedLinear.load_full
        self.e_score_correction_bias = None
        if config.method == "noaux_tc":
            self.e_score_correction_bias = _param(config.num_experts, dtype=torch.float32)
            self.e_score_correction_bias.weight_loader = ReplicatedLinear.load_full

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        logits = F.linear(hidden.float(), self.weight)
        scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
        if cfg.method == "greedy":
            weights, ids = torch.topk(scores, cfg.top_k, dim=-1, sorted=False)
        elif cfg.method == "group_limited_greedy":
            groups = scores.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
            keep = self._group_mask(groups.max(dim=-1).values)
            weights, ids = torch.topk(scores.masked_fill(~keep, 0.0), cfg.top_k, dim=-1,
                                      sorted=False)
        else:  # noaux_tc: the bias picks experts; weights stay the unbiased scores
            choice = scores + self.e_score_correction_bias
            groups = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
            keep = self._group_mask(groups.topk(2, dim=-1).values.sum(dim=-1))
            ids = torch.topk(choice.masked_fill(~keep, float("-inf")), cfg.top_k, dim=-1,
                             sorted=False).indices
            weights = scores.gather(1, ids)
        if cfg.norm_topk_prob and (cfg.top_k > 1 or cfg.scale_after_norm):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            if cfg.scale_after_norm:
                weights = weights * cfg.routed_scaling_factor
        else:
            weights = weights * cfg.routed_scaling_factor
        return weights, ids

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, groups] -> [T, experts] bool: experts of each token's `topk_group` best groups."""
        cfg = self.config
        best = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return keep.repeat_interleave(cfg.num_experts // cfg.num_groups, dim=1)


class RoutedExperts(nn.Module):
    """All routed experts' SwiGLU MLPs, this rank's slice of each intermediate dimension.

    Dispatch is grouped: the (token, expert) pairs are sorted by expert, each expert runs one
    GEMM over its contiguous rows, and the weighted rows are summed back per token.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.start, self.size = split_range(intermediate_size, comm.world_size, comm.rank)
        self.w13 = _param(num_experts, 2 * self.size, hidden_size, dtype=dtype)
        self.w2 = _param(num_experts, hidden_size, self.size, dtype=dtype)
        for param, parts in ((self.w13, ("gate_proj", "up_proj")), (self.w2, ("down_proj",))):
            param.weight_loader = self.load_expert
            param.shard_ids = [(e, part) for e in range(num_experts) for part in parts]

    def load_expert(self, param: nn.Parameter, weight: LazyWeight, shard_id: object) -> None:
        expert, part = shard_id
        if part == "down_proj":
            _copy_checked(param.data[expert], weight.narrow(1, self.start, self.size),
                          f"expert {expert} down_proj")
        else:
            offset = 0 if part == "gate_proj" else self.size
            _copy_checked(param.data[expert].narrow(0, offset, self.size),
                          weight.narrow(0, self.start, self.size), f"expert {expert} {part}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H], weights/ids: [T, k] -> this rank's partial [T, H] (summed over ranks)."""
        top_k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, tokens)
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                part = rows[start:start + count]
                gate, up = F.linear(part, self.w13[expert]).chunk(2, dim=-1)
                out[start:start + count] = F.linear(F.silu(gate) * up, self.w2[expert])
                start += count
        out *= weights.flatten()[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out)


class SparseMoE(nn.Module):
    """Routed experts without shared ones (Qwen3-MoE, Mixtral): `gate` picks each token's
    experts, `experts` computes this rank's partial output (the caller all-reduces it)."""

    def __init__(self, hidden_size: int, intermediate_size: int, router: RouterConfig,
                 comm: Communicator, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, router)
        self.experts = RoutedExperts(router.num_experts, hidden_size, intermediate_size, comm,
                                     dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, *self.gate(hidden))


# Per-expert checkpoint tensors as DeepSeek and Qwen3-MoE name them.
_EXPERT_WEIGHT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def expert_checkpoint_param(name: str) -> tuple[str, object] | None:
    """(stacked parameter, shard id) of a per-expert checkpoint tensor
    (`...mlp.experts.3.up_proj.weight` -> `...mlp.experts.w13`, (3, "up_proj")), for a
    model's `checkpoint_param`; None for other names."""
    match = _EXPERT_WEIGHT.fullmatch(name)
    if match is None:
        return None
    prefix, expert, part = match.groups()
    return f"{prefix}.{'w2' if part == 'down_proj' else 'w13'}", (int(expert), part)
