"""The Triton kernels that the layers launch, as torch custom ops for torch.compile.

Dynamo cannot trace into a Triton launcher written in Python (it reads strides, picks tile
sizes, allocates), so a compiled forward would break its graph at every kernel. Registered as
`torch.library.custom_op`s with fake implementations (shapes, dtypes and strides of the outputs,
nothing computed), the kernels are opaque nodes of one graph, and inductor compiles what lies
between them.

The layers call the functions at the bottom of this module and of its siblings,
`custom_ops_moe` (router, fused MoE), `custom_ops_attention` (KV stores, decode attention)
and `custom_ops_fp8` (the FP8 absorbed-weight bmm). Each runs its kernel directly when
called eagerly (no dispatcher on the eager hot path) and goes through its op only while
dynamo traces (`torch.compiler.is_compiling()`), so the compiled and the eager forwards run
the same kernels. Ops that write into an argument (the KV pool, the MLA query buffer) declare
it in `mutates_args`; inductor then writes in place.

Op names live under the `engine` namespace: torch.ops.engine.<name>.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kernels import activation as _activation
from engine.kernels import mla_preamble as _mla_preamble
from engine.kernels import norm as _norm
from engine.kernels import rope as _rope

tracing = torch.compiler.is_compiling  # the siblings import it too
_tracing = tracing


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
    store: _mla_preamble.PoolRow | None = None,
) -> tuple[Tensor, Tensor]:
    """As `engine.kernels.mla_preamble.mla_preamble` (`store` eagerly only: a compiled forward
    stores through the attention backend)."""
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
            store,
        )
    assert store is None, "a traced preamble does not store into the KV pool"

    if q_pe_out is None:
        q_pe_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    latent = _mla_preamble_op(
        kv_a, q_pe, norm_weight, eps, positions, inv_freq, attention_scaling, interleaved, q_pe_out
    )
    return latent, q_pe_out
