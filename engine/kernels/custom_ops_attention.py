"""The KV-pool stores and the decode attention kernels as torch custom ops (see
`engine.kernels.custom_ops`)."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kernels import gqa_decode as _gqa_decode
from engine.kernels import kv_store as _kv_store
from engine.kernels import mla_decode as _mla_decode
from engine.kernels.custom_ops import tracing as _tracing


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


def _gluon_config(
    q: Tensor, kv_buffer: Tensor, kv_lora_rank: int, max_seq_len: int
) -> _mla_decode.MLADecodeConfig:
    batch, num_heads, head_dim = q.shape
    fp8 = kv_buffer.dtype == torch.float8_e4m3fn
    rope_dim = head_dim - kv_lora_rank
    return _mla_decode.gluon_config(num_heads, batch, max_seq_len, fp8, kv_lora_rank, rope_dim)


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
    value_proj: Tensor | None = None,
    gluon: bool = False,
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
        value_proj=value_proj,
        config=_gluon_config(q, kv_buffer, kv_lora_rank, max_seq_len) if gluon else None,
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
    value_proj: Tensor | None = None,
    gluon: bool = False,
) -> Tensor:
    width = kv_lora_rank if value_proj is None else value_proj.shape[2]
    return q.new_empty(q.shape[0], q.shape[1], width)


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
    value_proj: Tensor | None = None,
    gluon: bool = False,
) -> Tensor:
    """As `engine.kernels.mla_decode.mla_decode`; `max_seq_len` is required (no host sync).
    `gluon`: the decode through the warp-specialized Gluon kernels (sm_90; an FP8 cache, or a
    16-bit one at 64+ heads)."""
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
            value_proj,
            gluon,
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
        value_proj=value_proj,
        config=_gluon_config(q, kv_buffer, kv_lora_rank, max_seq_len) if gluon else None,
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
