"""The Triton kernels that the layers launch, as torch custom ops for torch.compile.

Dynamo cannot trace into a Triton launcher written in Python (it reads strides, picks tile
sizes, allocates), so a compiled forward would break its graph at every kernel. Registered as
`torch.library.custom_op`s with fake implementations (shapes, dtypes and strides of the outputs,
nothing computed), the kernels are opaque nodes of one graph, and inductor compiles what lies
between them.

The layers call the functions at the bottom of this file. Each runs its kernel directly when
called eagerly (no dispatcher on the eager hot path) and goes through its op only while dynamo
traces (`torch.compiler.is_compiling()`), so the compiled and the eager forwards run the same
kernels. Ops that write into an argument (the KV pool, the MLA query buffer) declare it in
`mutates_args`; inductor then writes in place.

Op names live under the `engine` namespace: torch.ops.engine.<name>.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kernels import activation as _activation
from engine.kernels import fused_moe as _fused_moe
from engine.kernels import gqa_decode as _gqa_decode
from engine.kernels import kv_store as _kv_store
from engine.kernels import mla_decode as _mla_decode
from engine.kernels import mla_preamble as _mla_preamble
from engine.kernels import moe_router as _moe_router
from engine.kernels import norm as _norm
from engine.kernels import rope as _rope
from engine.kernels.fused_moe import SharedExperts
from engine.kernels.moe_router import RouterOutput

_tracing = torch.compiler.is_compiling


# ---- norms and activation -------------------------------------------------------------------
@torch.library.custom_op("engine::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _norm.rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@torch.library.custom_op("engine::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm_op(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    return _norm.fused_add_rms_norm(x, residual, weight, eps)


@_fused_add_rms_norm_op.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    out = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    return out, x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))


@torch.library.custom_op("engine::silu_and_mul", mutates_args=())
def _silu_and_mul_op(gate_up: Tensor) -> Tensor:
    return _activation.silu_and_mul(gate_up)


@_silu_and_mul_op.register_fake
def _(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,))


# ---- RoPE and the MLA preamble --------------------------------------------------------------
@torch.library.custom_op("engine::rotary_embedding", mutates_args=())
def _rotary_embedding_op(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    inv_freq: Tensor,
    attention_scaling: float,
    interleaved: bool,
) -> tuple[Tensor, Tensor]:
    return _rope.rotary_embedding(positions, q, k, inv_freq, attention_scaling, interleaved)


@_rotary_embedding_op.register_fake
def _(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    inv_freq: Tensor,
    attention_scaling: float,
    interleaved: bool,
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("engine::mla_preamble", mutates_args=("q_pe_out",))
def _mla_preamble_op(
    kv_a: Tensor,
    q_pe: Tensor,
    norm_weight: Tensor,
    eps: float,
    positions: Tensor,
    inv_freq: Tensor,
    attention_scaling: float,
    interleaved: bool,
    q_pe_out: Tensor,
) -> Tensor:
    latent, _ = _mla_preamble.mla_preamble(
        kv_a, q_pe, norm_weight, eps, positions, inv_freq, attention_scaling, interleaved, q_pe_out
    )
    return latent


@_mla_preamble_op.register_fake
def _(
    kv_a: Tensor,
    q_pe: Tensor,
    norm_weight: Tensor,
    eps: float,
    positions: Tensor,
    inv_freq: Tensor,
    attention_scaling: float,
    interleaved: bool,
    q_pe_out: Tensor,
) -> Tensor:
    return kv_a.new_empty(kv_a.shape)


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


# ---- KV store and decode attention ----------------------------------------------------------
@torch.library.custom_op("engine::store_mla_kv", mutates_args=("kv_buffer",))
def _store_mla_kv_op(
    kv_buffer: Tensor, loc: Tensor, latent: Tensor, k_scale: Tensor | None
) -> None:
    _kv_store.store_mla_kv(kv_buffer, loc, latent, k_scale)


@_store_mla_kv_op.register_fake
def _(kv_buffer: Tensor, loc: Tensor, latent: Tensor, k_scale: Tensor | None) -> None:
    return None


@torch.library.custom_op("engine::store_kv", mutates_args=("k_buffer", "v_buffer"))
def _store_kv_op(
    k_buffer: Tensor,
    v_buffer: Tensor,
    loc: Tensor,
    k: Tensor,
    v: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> None:
    _kv_store.store_kv(k_buffer, v_buffer, loc, k, v, k_scale, v_scale)


@_store_kv_op.register_fake
def _(
    k_buffer: Tensor,
    v_buffer: Tensor,
    loc: Tensor,
    k: Tensor,
    v: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> None:
    return None


@torch.library.custom_op("engine::mla_decode", mutates_args=())
def _mla_decode_op(
    q: Tensor,
    kv_buffer: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    k_scale: Tensor | None,
    max_seq_len: int,
    page_size: int,
) -> Tensor:
    return _mla_decode.mla_decode(
        q,
        kv_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_lora_rank,
        sm_scale,
        k_scale=k_scale,
        max_seq_len=max_seq_len,
        page_size=page_size,
    )


@_mla_decode_op.register_fake
def _(
    q: Tensor,
    kv_buffer: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    k_scale: Tensor | None,
    max_seq_len: int,
    page_size: int,
) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)


@torch.library.custom_op("engine::gqa_decode", mutates_args=())
def _gqa_decode_op(
    q: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    sm_scale: float,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    max_seq_len: int,
) -> Tensor:
    out = _gqa_decode.gqa_decode(
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        sm_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        max_seq_len=max_seq_len,
    )
    # NOTE: the kernel returns a column slice when v_head_dim is not a power of two; an op's
    # output may not be a view, so that case is copied.
    return out if out.is_contiguous() else out.contiguous()


@_gqa_decode_op.register_fake
def _(
    q: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    sm_scale: float,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    max_seq_len: int,
) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v_buffer.shape[2])


# ---- what the layers call -------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if _tracing():
        return _rms_norm_op(x, weight, eps)
    return _norm.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    if _tracing():
        return _fused_add_rms_norm_op(x, residual, weight, eps)
    return _norm.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    if _tracing():
        return _silu_and_mul_op(gate_up)
    return _activation.silu_and_mul(gate_up)


def rotary_embedding(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    inv_freq: Tensor,
    attention_scaling: float,
    interleaved: bool,
) -> tuple[Tensor, Tensor]:
    if _tracing():
        return _rotary_embedding_op(positions, q, k, inv_freq, attention_scaling, interleaved)
    return _rope.rotary_embedding(positions, q, k, inv_freq, attention_scaling, interleaved)


def mla_preamble(
    kv_a: Tensor,
    q_pe: Tensor,
    norm_weight: Tensor,
    eps: float,
    positions: Tensor,
    inv_freq: Tensor,
    attention_scaling: float,
    interleaved: bool,
    q_pe_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """As `engine.kernels.mla_preamble.mla_preamble`."""
    if not _tracing():
        return _mla_preamble.mla_preamble(
            kv_a,
            q_pe,
            norm_weight,
            eps,
            positions,
            inv_freq,
            attention_scaling,
            interleaved,
            q_pe_out,
        )
    if q_pe_out is None:
        q_pe_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    latent = _mla_preamble_op(
        kv_a, q_pe, norm_weight, eps, positions, inv_freq, attention_scaling, interleaved, q_pe_out
    )
    return latent, q_pe_out


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
) -> RouterOutput:
    """As `engine.kernels.moe_router.moe_router` (the gate fused by the weight's size)."""
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
        )
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


def store_mla_kv(
    kv_buffer: Tensor, loc: Tensor, latent: Tensor, k_scale: Tensor | None = None
) -> None:
    if _tracing():
        _store_mla_kv_op(kv_buffer, loc, latent, k_scale)
    else:
        _kv_store.store_mla_kv(kv_buffer, loc, latent, k_scale)


def store_kv(
    k_buffer: Tensor,
    v_buffer: Tensor,
    loc: Tensor,
    k: Tensor,
    v: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    if _tracing():
        _store_kv_op(k_buffer, v_buffer, loc, k, v, k_scale, v_scale)
    else:
        _kv_store.store_kv(k_buffer, v_buffer, loc, k, v, k_scale, v_scale)


def mla_decode(
    q: Tensor,
    kv_buffer: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    *,
    k_scale: Tensor | None,
    max_seq_len: int,
    page_size: int,
) -> Tensor:
    """As `engine.kernels.mla_decode.mla_decode`; `max_seq_len` is required (no host sync)."""
    if _tracing():
        return _mla_decode_op(
            q,
            kv_buffer,
            req_to_token,
            req_pool_indices,
            seq_lens,
            kv_lora_rank,
            sm_scale,
            k_scale,
            max_seq_len,
            page_size,
        )
    return _mla_decode.mla_decode(
        q,
        kv_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_lora_rank,
        sm_scale,
        k_scale=k_scale,
        max_seq_len=max_seq_len,
        page_size=page_size,
    )


def gqa_decode(
    q: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    sm_scale: float,
    *,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    max_seq_len: int,
) -> Tensor:
    """As `engine.kernels.gqa_decode.gqa_decode`; `max_seq_len` is required (no host sync)."""
    if _tracing():
        return _gqa_decode_op(
            q,
            k_buffer,
            v_buffer,
            req_to_token,
            req_pool_indices,
            seq_lens,
            sm_scale,
            k_scale,
            v_scale,
            max_seq_len,
        )
    return _gqa_decode.gqa_decode(
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        sm_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        max_seq_len=max_seq_len,
    )
