"""Mixture-of-experts routing (DeepSeek-V2 and V3) and the torch-native expert computation."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import ParallelState
from engine.distributed.sharding import ShardSpec


class TopkRouter(nn.Module):
    """Picks `top_k` experts per token and their weights.

    V2 ("greedy" / "group_limited_greedy"): softmax scores; V3 ("noaux_tc"): sigmoid scores plus a
    correction bias used only for the choice, groups ranked by the sum of their top two scores.
    The router runs in float32 with a float32 weight, as the reference does.
    """

    def __init__(self, hf: Any, hidden_size: int, num_experts: int, is_v3: bool) -> None:
        super().__init__()
        self.top_k: int = hf.num_experts_per_tok
        self.num_experts = num_experts
        self.is_v3 = is_v3
        self.topk_method = "noaux_tc" if is_v3 else (getattr(hf, "topk_method", None) or "greedy")
        self.num_group: int = getattr(hf, "n_group", None) or 1
        self.topk_group: int = getattr(hf, "topk_group", None) or 1
        self.norm_topk_prob = bool(getattr(hf, "norm_topk_prob", False))
        self.routed_scaling_factor = float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0)
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=torch.float32))
        if is_v3:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
        logits = F.linear(x.float(), self.weight.float())
        if self.is_v3:
            return self._route_v3(logits)
        scores = logits.softmax(dim=-1)
        if self.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, self.num_group, self._group_size()).amax(dim=-1)
            scores = scores.masked_fill(~self._expert_mask(group_scores), 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * self.routed_scaling_factor
        return weights, ids

    def _route_v3(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(-1, self.num_group, self._group_size()).topk(2, dim=-1)[0]
        choice = choice.masked_fill(~self._expert_mask(group_scores.sum(dim=-1)), float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def _group_size(self) -> int:
        return self.num_experts // self.num_group

    def _expert_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, groups] scores -> [T, experts] bool: the experts of the `topk_group` best groups."""
        group_idx = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return group_mask.repeat_interleave(self._group_size(), dim=-1)


class Experts(nn.Module):
    """Routed experts stacked as w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I].

    Under tensor parallelism every rank holds every expert, but only its slice of each expert's
    intermediate dim (TP-MoE): I is this rank's share, and the output is a partial sum that the
    caller all-reduces (once, together with the shared experts).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelState | None = None,
    ) -> None:
        super().__init__()
        parallel = parallel or ParallelState()
        start, size = parallel.shard(intermediate_size, "MoE intermediate features")
        self.num_experts = num_experts
        self.full_intermediate_size = intermediate_size
        self.intermediate_start = start
        self.intermediate_size = size  # this rank's
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, size))
        # "auto": the fused Triton kernel on CUDA (no host sync, so CUDA-graph safe), the
        # per-expert loop elsewhere; tests set "triton" to run the kernel under the interpreter.
        self.kernel = "auto"

    def shard_specs(self) -> tuple[ShardSpec, ShardSpec]:
        """This rank's slice of one expert's checkpoint gate/up [I, H] and down [H, I]."""
        start, size, full = (
            self.intermediate_start,
            self.intermediate_size,
            self.full_intermediate_size,
        )
        return ShardSpec(0, start, size, full), ShardSpec(1, start, size, full)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.kernel == "triton" or (self.kernel == "auto" and x.is_cuda):
            from engine.kernels.fused_moe import fused_moe

            return fused_moe(
                x.contiguous(), self.w13_weight, self.w2_weight, topk_weights, topk_ids
            )
        return moe_forward_native(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


def moe_forward_native(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference MoE: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk [T, k] -> [T, H] in x's dtype.

    Loops over the experts that received tokens; each token's output is the weighted sum of its
    experts' SiLU-gated MLPs. `compute_dtype` (default x's dtype) is what the math and the sum
    run in; weights are cast one expert at a time (the kernels' reference passes float32).
    """
    dtype = compute_dtype or x.dtype
    xc = x.to(dtype)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    weight_of = topk_weights.reshape(-1)
    for expert in torch.unique(flat_ids).tolist():
        sel = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = token_of[sel]
        gate, up = F.linear(xc[tokens], w13[expert].to(dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert].to(dtype))
        out.index_add_(0, tokens, (y * weight_of[sel, None]).to(dtype))
    return out.to(x.dtype)
