"""Mixture-of-experts routing (DeepSeek-V2 and V3) and the torch-native expert computation."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import ParallelState
from engine.distributed.sharding import ShardSpec
from engine.kernels.custom_ops_moe import fused_moe, moe_router
from engine.kernels.fused_moe import SharedExperts


class TopkRouter(nn.Module):
    """Picks `top_k` experts per token and their weights.

    V2 ("greedy" / "group_limited_greedy"): softmax scores; V3 ("noaux_tc"): sigmoid scores plus a
    correction bias used only for the choice, groups ranked by the sum of their top two scores.
    The logits are computed in float32 from the weight as stored (the model's dtype, as in
    transformers). On CUDA the whole router (gate GEMM included) is one Triton kernel
    (`engine.kernels.moe_router`); elsewhere `select_experts_native`, its reference.
    """

    def __init__(self, hf: Any, hidden_size: int, num_experts: int, is_v3: bool) -> None:
        super().__init__()
        self.top_k: int = hf.num_experts_per_tok
        self.num_experts = num_experts
        self.is_v3 = is_v3
        self.topk_method = "noaux_tc" if is_v3 else (getattr(hf, "topk_method", None) or "greedy")
        num_group: int = getattr(hf, "n_group", None) or 1
        grouped = is_v3 or self.topk_method == "group_limited_greedy"
        self.num_group = num_group if grouped else 1
        self.topk_group: int = getattr(hf, "topk_group", None) or 1
        norm_topk_prob = bool(getattr(hf, "norm_topk_prob", False))
        routed_scaling_factor = float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0)
        # V2 either renormalises or scales; V3 renormalises (if asked) and scales.
        self.renormalize = norm_topk_prob and (is_v3 or self.top_k > 1)
        self.scale = routed_scaling_factor if is_v3 or not self.renormalize else 1.0
        self.scoring = "sigmoid" if is_v3 else "softmax"
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.e_score_correction_bias: nn.Parameter | None = None
        if is_v3:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
        # "auto": the Triton kernel on CUDA, the torch code elsewhere ("triton" / "native"
        # force one, for tests).
        self.kernel = "auto"

    def uses_kernel(self, x: torch.Tensor) -> bool:
        return self.kernel == "triton" or (self.kernel == "auto" and x.is_cuda)

    def forward(
        self, x: torch.Tensor, num_shared: int = 0, gate_partials: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_weights [T, k] float32, topk_ids [T, k] int32 on the kernel
        path, int64 on the torch path); `num_shared` > 0 appends the shared experts' slots
        (`append_shared_experts`). `gate_partials` (kernel path): the gate logits computed
        already, as `engine.kernels.moe_router.norm_gate_logits` gives them."""
        routing: dict[str, Any] = dict(
            scoring=self.scoring,
            correction_bias=self.e_score_correction_bias,
            num_groups=self.num_group,
            topk_group=self.topk_group,
            renormalize=self.renormalize,
            scale=self.scale,
        )
        if self.uses_kernel(x):
            out = moe_router(
                x, self.weight, self.top_k, num_shared=num_shared, gate_partials=gate_partials,
                **routing,
            )  # fmt: skip
            return out.topk_weights, out.topk_ids
        assert gate_partials is None, "gate_partials come from the kernel path"
        logits = F.linear(x.float(), self.weight.float())
        weights, ids = select_experts_native(logits, self.top_k, **routing)
        return append_shared_experts(weights, ids, self.num_experts, num_shared)


def append_shared_experts(
    weights: torch.Tensor, ids: torch.Tensor, num_experts: int, num_shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing [T, k] -> [T, k + num_shared]: every token also takes experts num_experts..
    (the shared experts' slots in the fused MoE) with weight 1."""
    if num_shared == 0:
        return weights, ids
    t = ids.shape[0]
    extra = torch.arange(num_experts, num_experts + num_shared, device=ids.device)
    return (
        torch.cat([weights, weights.new_ones(t, num_shared)], dim=1),
        torch.cat([ids, extra.to(ids.dtype).expand(t, num_shared)], dim=1),
    )


def select_experts_native(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_group: int = 1,
    renormalize: bool = False,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, k] float32, ids [T, k] int64): DeepSeek's routing,
    as `engine.kernels.moe_router` documents it."""
    num_experts = logits.shape[-1]
    if scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
        if num_groups > 1:
            grouped = choice.view(-1, num_groups, num_experts // num_groups)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            keep = _group_mask(group_scores, topk_group, num_experts)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        scores = logits.softmax(dim=-1)
        if num_groups > 1:
            group_scores = scores.view(-1, num_groups, num_experts // num_groups).amax(dim=-1)
            scores = scores.masked_fill(~_group_mask(group_scores, topk_group, num_experts), 0.0)
        weights, ids = torch.topk(scores, top_k, dim=-1, sorted=False)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """[T, groups] scores -> [T, experts] bool: the experts of the `topk_group` best groups."""
    group_idx = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return group_mask.repeat_interleave(num_experts // group_scores.shape[-1], dim=-1)


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

    def uses_kernel(self, x: torch.Tensor) -> bool:
        return self.kernel == "triton" or (self.kernel == "auto" and x.is_cuda)

    def shard_specs(self) -> tuple[ShardSpec, ShardSpec]:
        """This rank's slice of one expert's checkpoint gate/up [I, H] and down [H, I]."""
        start, size, full = (
            self.intermediate_start,
            self.intermediate_size,
            self.full_intermediate_size,
        )
        return ShardSpec(0, start, size, full), ShardSpec(1, start, size, full)

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_output: torch.Tensor | None = None,
        shared_experts: SharedExperts | None = None,
    ) -> torch.Tensor:
        """The routed experts' weighted sum, plus `shared_output` (the shared experts' output:
        on the kernel path it joins the final sum instead of costing an add of its own).
        `shared_experts` (kernel path only): the shared MLP's weights, run inside the fused MoE
        as the experts that topk_ids name past the routed ones."""
        w13, w2 = self.w13_weight, self.w2_weight
        if self.uses_kernel(x):
            return fused_moe(
                x.contiguous(),
                w13,
                w2,
                topk_weights,
                topk_ids,
                shared_output=shared_output,
                shared_experts=shared_experts,
            )
        assert shared_experts is None, "the shared experts run inside the fused MoE kernel only"
        # NOTE: the torch code loops over the chosen experts on the host (data-dependent shapes):
        # a compiled forward runs it eagerly, between its compiled pieces.
        native = _moe_forward_untraced if torch.compiler.is_compiling() else moe_forward_native
        out = native(x, w13, w2, topk_weights, topk_ids)
        return out if shared_output is None else out + shared_output


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


_moe_forward_untraced = torch.compiler.disable(moe_forward_native)
