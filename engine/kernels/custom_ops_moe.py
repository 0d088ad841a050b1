"""The MoE router and the fused MoE as torch custom ops (see `engine.kernels.custom_ops`)."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kernels import fused_moe as _fused_moe
from engine.kernels import moe_router as _moe_router
from engine.kernels.custom_ops import tracing as _tracing
from engine.kernels.fused_moe import SharedExperts
from engine.kernels.moe_router import RouterOutput


# ---- MoE ------------------------------------------------------------------------------------
@torch.library.custom_op("engine::moe_router", mutates_args=())
def _moe_router_op(
    x: Tensor,
    weight: Tensor,
    top_k: int,
    scoring: str,
    correction_bias: Tensor | None,
    num_groups: int,
    topk_group: int,
    renormalize: bool,
    scale: float,
    num_shared: int,
) -> tuple[Tensor, Tensor]:
    out = _moe_router.moe_router(
        x,
        weight,
        top_k,
        scoring=scoring,
        correction_bias=correction_bias,
        num_groups=num_groups,
        topk_group=topk_group,
        renormalize=renormalize,
        scale=scale,
        num_shared=num_shared,
    )
    return out.topk_weights, out.topk_ids


@_moe_router_op.register_fake
def _(
    x: Tensor,
    weight: Tensor,
    top_k: int,
    scoring: str,
    correction_bias: Tensor | None,
    num_groups: int,
    topk_group: int,
    renormalize: bool,
    scale: float,
    num_shared: int,
) -> tuple[Tensor, Tensor]:
    width = top_k + num_shared
    return (
        x.new_empty(x.shape[0], width, dtype=torch.float32),
        x.new_empty(x.shape[0], width, dtype=torch.int32),
    )


@torch.library.custom_op("engine::fused_moe", mutates_args=())
def _fused_moe_op(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    shared_output: Tensor | None,
    shared_gate_up: Tensor | None,
    shared_down: Tensor | None,
) -> Tensor:
    shared = None
    if shared_gate_up is not None and shared_down is not None:
        shared = SharedExperts(shared_gate_up, shared_down)
    return _fused_moe.fused_moe(
        hidden,
        w13,
        w2,
        topk_weights,
        topk_ids,
        shared_output=shared_output,
        shared_experts=shared,
    )


@_fused_moe_op.register_fake
def _(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    shared_output: Tensor | None,
    shared_gate_up: Tensor | None,
    shared_down: Tensor | None,
) -> Tensor:
    return hidden.new_empty(hidden.shape)


def moe_router(
    x: Tensor,
    weight: Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    correction_bias: Tensor | None = None,
    num_groups: int = 1,
    topk_group: int = 1,
    renormalize: bool = False,
    scale: float = 1.0,
    num_shared: int = 0,
    gate_partials: Tensor | None = None,
) -> RouterOutput:
    """As `engine.kernels.moe_router.moe_router` (the gate fused by the weight's size;
    `gate_partials` eagerly only)."""
    if not _tracing():
        return _moe_router.moe_router(
            x,
            weight,
            top_k,
            scoring=scoring,
            correction_bias=correction_bias,
            num_groups=num_groups,
            topk_group=topk_group,
            renormalize=renormalize,
            scale=scale,
            num_shared=num_shared,
            gate_partials=gate_partials,
        )
    assert gate_partials is None, "a compiled forward computes the gate logits in the router"
    weights, ids = _moe_router_op(
        x,
        weight,
        top_k,
        scoring,
        correction_bias,
        num_groups,
        topk_group,
        renormalize,
        scale,
        num_shared,
    )
    return RouterOutput(weights, ids)


def fused_moe(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    shared_output: Tensor | None = None,
    shared_experts: SharedExperts | None = None,
) -> Tensor:
    """As `engine.kernels.fused_moe.fused_moe` (its default tile config)."""
    if not _tracing():
        return _fused_moe.fused_moe(
            hidden,
            w13,
            w2,
            topk_weights,
            topk_ids,
            shared_output=shared_output,
            shared_experts=shared_experts,
        )
    gate_up, down = shared_experts if shared_experts is not None else (None, None)
    return _fused_moe_op(hidden, w13, w2, topk_weights, topk_ids, shared_output, gate_up, down)
