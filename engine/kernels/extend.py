"""Extend (prefill) attention: new tokens attend to their cached prefix plus, causally, to each
other. Serves MLA's decompressed path (q/k head dim 192, v 128, as many KV heads as query heads)
and GQA (query heads grouped over KV heads).

Inputs follow SGLang's layout: the new tokens of all requests are concatenated
(`extend_start_loc` [B] gives each request's first row), their K/V are passed directly, and the
prefix K/V are read from the pool through `req_to_token` (positions 0 .. prefix_len - 1).

`ragged_attention` is the same kernel with every request's whole context (prefix, then new
tokens) given as K/V rows, requests concatenated: MLA's prefill up-projects the cached latents
of the prefix and attends over them (its pool holds latents, not per-head K/V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import launch
from engine.kernels.utils import (
    INTERPRET_UPCAST,
    cdiv,
    dot,
    is_interpreter,
    next_power_of_2,
    online_softmax_step,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _rope_scores(q_pe, k_pe_ptr, rows, mask_n, offs_r, mask_r, stride_kps, UPCAST: tl.constexpr):
    """q_pe [BLOCK_M, BLOCK_R] against the RoPE key rows `rows` of k_pe -> [BLOCK_M, BLOCK_N]."""
    k_pe_ptrs = k_pe_ptr + rows.to(tl.int64)[None, :] * stride_kps + offs_r[:, None]
    k_pe = tl.load(k_pe_ptrs, mask=mask_n[None, :] & mask_r[:, None], other=0.0)
    return dot(q_pe, k_pe.to(q_pe.dtype), UPCAST)


@triton.jit
def _extend_kernel(
    q_ptr,  # [T, Hq, D]
    k_ext_ptr,  # [T, Hkv, D]
    v_ext_ptr,  # [T, Hkv, Dv]
    k_buf_ptr,  # [num_slots, Hkv, D]
    v_buf_ptr,  # [num_slots, Hkv, Dv]
    o_ptr,  # [T, Hq, Dv]
    req_to_token_ptr,
    req_idx_ptr,
    seq_lens_ptr,
    prefix_lens_ptr,
    start_loc_ptr,
    kv_start_ptr,  # [B] first context row of each request (RAGGED only)
    q_pe_ptr,  # [T, Hq, R] (ROPE)
    k_pe_ptr,  # [S, R] one row for all heads (ROPE)
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_ot, stride_oh, stride_rt,
    stride_qpt, stride_qph, stride_kps,
    group_size, head_dim, v_head_dim, rope_dim,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    RAGGED: tl.constexpr, UPCAST: tl.constexpr, BLOCK_R: tl.constexpr = 0,
):  # fmt: skip
    # RAGGED: k_buf/v_buf hold request b's whole context at rows kv_start[b] onwards (its new
    # tokens' K/V included, k_ext/v_ext unused); else the prefix is read through req_to_token
    # and the new tokens' K/V are rows start_loc[b] onwards of k_ext/v_ext.
    # BLOCK_R > 0 (RAGGED): the head dim is head_dim + rope_dim, its last rope_dim columns given
    # apart: q's in q_pe, k's in k_pe, one row for all heads (MLA's decoupled RoPE key), so that
    # neither is concatenated and each product is a power of two wide (not 192 padded to 256).
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    kvh = h // group_size
    prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
    ext_len = tl.load(seq_lens_ptr + b).to(tl.int32) - prefix_len
    if mblk * BLOCK_M >= ext_len:
        return
    start = tl.load(start_loc_ptr + b).to(tl.int64)
    if RAGGED:
        kv0 = tl.load(kv_start_ptr + b).to(tl.int64)
        ext_row0 = kv0 + prefix_len
        row = 0
    else:
        kv0 = 0
        ext_row0 = start
        row = tl.load(req_idx_ptr + b).to(tl.int64)

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < head_dim
    mask_dv = offs_dv < v_head_dim
    q_ptrs = q_ptr + (start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if BLOCK_R > 0:  # a compile-time branch: q_pe, offs_r and mask_r exist only with BLOCK_R
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rope_dim
        q_pe_ptrs = q_pe_ptr + (start + offs_m[:, None]) * stride_qpt + h * stride_qph
        q_pe = tl.load(
            q_pe_ptrs + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :], other=0.0
        )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # The cached prefix: every new token sees all of it.
    for n in range(0, prefix_len, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        if RAGGED:
            slot = kv0 + offs_n
        else:
            slot = tl.load(req_to_token_ptr + row * stride_rt + offs_n, mask=mask_n, other=0)
            slot = slot.to(tl.int64)
        k_ptrs = k_buf_ptr + slot[None, :] * stride_kbs + kvh * stride_kbh + offs_d[:, None]
        k = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        v_ptrs = v_buf_ptr + slot[:, None] * stride_vbs + kvh * stride_vbh + offs_dv[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
        qk = dot(q, k.to(q.dtype), UPCAST)
        if BLOCK_R > 0:
            qk += _rope_scores(q_pe, k_pe_ptr, slot, mask_n, offs_r, mask_r, stride_kps, UPCAST)
        qk = qk * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(qk, m_i, l_i)
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v.to(q.dtype), UPCAST)

    # The new tokens, causally: token i sees new tokens j <= i.
    end = tl.minimum((mblk + 1) * BLOCK_M, ext_len)
    for n in range(0, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ext_len
        k_ptrs = k_ext_ptr + (ext_row0 + offs_n[None, :]) * stride_kt + kvh * stride_kh
        k = tl.load(k_ptrs + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        v_ptrs = v_ext_ptr + (ext_row0 + offs_n[:, None]) * stride_vt + kvh * stride_vh
        v = tl.load(v_ptrs + offs_dv[None, :], mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
        qk = dot(q, k.to(q.dtype), UPCAST)
        if BLOCK_R > 0:
            rows = ext_row0 + offs_n
            qk += _rope_scores(q_pe, k_pe_ptr, rows, mask_n, offs_r, mask_r, stride_kps, UPCAST)
        qk = qk * qk_scale
        causal = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(qk, m_i, l_i)
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v.to(q.dtype), UPCAST)

    out = acc / l_i[:, None]
    o_ptrs = o_ptr + (start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])


def _launch(
    q: torch.Tensor,
    k_ext: torch.Tensor,
    v_ext: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    kv_start_loc: torch.Tensor | None,
    sm_scale: float,
    max_extend_len: int | None,
    q_pe: torch.Tensor | None = None,
    k_pe: torch.Tensor | None = None,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = k_ext.shape[1], v_ext.shape[2]
    rope_dim = 0
    q_pe_args: tuple[torch.Tensor, torch.Tensor, int, int, int] = (q, q, 0, 0, 0)
    if q_pe is not None:
        assert k_pe is not None and kv_start_loc is not None, "the split RoPE part is ragged only"
        k_pe = k_pe.reshape(k_pe.shape[0], -1)
        rope_dim = k_pe.shape[1]
        assert q_pe.shape == (num_tokens, num_q_heads, rope_dim) and k_pe.shape[0] == k_ext.shape[0]
        assert q_pe.stride(2) == 1 and k_pe.stride(1) == 1
        q_pe_args = (q_pe, k_pe, q_pe.stride(0), q_pe.stride(1), k_pe.stride(0))
    batch = seq_lens.shape[0]
    out = q.new_empty((num_tokens, num_q_heads, v_head_dim))
    if num_tokens == 0:
        return out
    if max_extend_len is None:
        max_extend_len = int((seq_lens - prefix_lens).max().item())  # NOTE: host sync
    block_d = next_power_of_2(head_dim)
    if is_interpreter():
        block_m, block_n, warps, stages = 16, 16, 4, 1
    else:
        block_m, block_n = (64, 64) if block_d + rope_dim <= 128 else (64, 32)
        warps, stages = 4, 2
    grid = (batch, num_q_heads, cdiv(max_extend_len, block_m))
    launch(
        _extend_kernel, grid,
        q, k_ext, v_ext, k_buf, v_buf, out, req_to_token, req_pool_indices,
        seq_lens, prefix_lens, q_start_loc,
        kv_start_loc if kv_start_loc is not None else q_start_loc, *q_pe_args[:2],
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_ext.stride(0), k_ext.stride(1),
        v_ext.stride(0), v_ext.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), *q_pe_args[2:],
        num_q_heads // num_kv_heads, head_dim, v_head_dim, rope_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_DV=next_power_of_2(v_head_dim), RAGGED=kv_start_loc is not None,
        UPCAST=INTERPRET_UPCAST, BLOCK_R=next_power_of_2(rope_dim) if rope_dim else 0,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def extend_attention(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    sm_scale: float,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """q_extend [T, Hq, D]; k_extend [T, Hkv, D]; v_extend [T, Hkv, Dv] (new tokens, all
    requests concatenated); k_buffer [num_slots, Hkv, D], v_buffer [num_slots, Hkv, Dv] (the
    pool, bf16/fp16/fp32); req_to_token [max_reqs, max_ctx]; req_pool_indices, seq_lens,
    prefix_lens, extend_start_loc [B]. Returns o [T, Hq, Dv] in q's dtype."""
    return _launch(
        q_extend, k_extend, v_extend, k_buffer, v_buffer, req_to_token, req_pool_indices,
        seq_lens, prefix_lens, extend_start_loc, None, sm_scale, max_extend_len,
    )  # fmt: skip


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    kv_start_loc: torch.Tensor,
    sm_scale: float,
    max_extend_len: int | None = None,
    q_pe: torch.Tensor | None = None,
    k_pe: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their request's whole context, given as rows.

    q [T, Hq, D] (new tokens, requests concatenated, request b from row q_start_loc[b]);
    k [S, Hkv, D], v [S, Hkv, Dv] (each request's seq_lens[b] context rows, prefix first, from
    row kv_start_loc[b]); seq_lens, prefix_lens [B]. Query i of request b sits at position
    prefix_lens[b] + i. Returns o [T, Hq, Dv] in q's dtype.

    With q_pe [T, Hq, R] and k_pe [S, R] (or [S, 1, R]): the heads' last R dims given apart,
    k_pe shared by every head (MLA's decoupled RoPE key): scores are q.k + q_pe.k_pe.
    """
    return _launch(
        q, k, v, k, v, seq_lens, seq_lens, seq_lens, prefix_lens, q_start_loc, kv_start_loc,
        sm_scale, max_extend_len, q_pe, k_pe,
    )  # fmt: skip
