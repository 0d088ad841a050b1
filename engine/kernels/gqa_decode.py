"""GQA/MHA decode attention for the Llama path: the grouped split-KV design of mla_decode.py.

One program takes one KV head and the query heads that share it (padded to 16 rows for the
MMA), over one split; stage 2 (`merge_splits`, shared with MLA) merges splits by log-sum-exp.
Slots are read through `req_to_token` (page size 1). FP8 pools are dequantized in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import launch
from engine.kernels.utils import (
    INTERPRET_UPCAST,
    choose_num_kv_splits,
    dot,
    is_interpreter,
    merge_splits,
    next_power_of_2,
    online_softmax_step,
    split_bounds,
    store_split,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _gqa_decode_stage1(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [num_slots, Hkv, D]
    v_ptr,  # [num_slots, Hkv, Dv]
    req_to_token_ptr,  # [max_reqs, max_ctx] int32
    req_idx_ptr,  # [B]
    seq_lens_ptr,  # [B]
    mid_o_ptr,  # [B, Hq, S, Dv] fp32
    mid_lse_ptr,  # [B, Hq, S] fp32 (log2)
    qk_scale,  # sm_scale * log2(e)
    k_scale_ptr,
    v_scale_ptr,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rt,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    group_size, head_dim, v_head_dim, num_splits,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_FP8: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    row, start, end = split_bounds(seq_lens_ptr, req_idx_ptr, b, split, num_splits, True, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_H)
    mask_g = offs_g < group_size
    heads = kvh * group_size + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < head_dim
    mask_dv = offs_dv < v_head_dim
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    scale = qk_scale
    out_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        out_scale = tl.load(v_scale_ptr)
        scale = scale * k_scale

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slot = tl.load(req_to_token_ptr + row * stride_rt + offs_n, mask=mask_n, other=0)
        slot = slot.to(tl.int64)
        k_ptrs = k_ptr + slot[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None]
        k = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [D, N]
        v_ptrs = v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # [N, Dv]
        if IS_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = dot(q, k, UPCAST) * scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(qk, m_i, l_i)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST)

    store_split(
        mid_o_ptr, mid_lse_ptr, acc, m_i, l_i, out_scale, b, split, heads, mask_g, offs_dv,
        mask_dv, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, end > start,
    )  # fmt: skip


def gqa_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; k_buffer [num_slots, Hkv, D]; v_buffer [num_slots, Hkv, Dv];
    req_to_token [max_reqs, max_ctx]; req_pool_indices [B]; seq_lens [B]. -> o [B, Hq, Dv].
    FP8 (e4m3) pools need k_scale and v_scale ([1] fp32)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = k_buffer.shape[1], v_buffer.shape[2]
    assert num_q_heads % num_kv_heads == 0
    group = num_q_heads // num_kv_heads
    is_fp8 = k_buffer.dtype == torch.float8_e4m3fn
    if is_fp8:
        assert k_scale is not None and v_scale is not None
    block_n = 16 if is_interpreter() else 64
    block_h = max(16, next_power_of_2(group))
    if num_kv_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())  # NOTE: a host sync; pass it when capturing
        num_kv_splits = choose_num_kv_splits(
            batch, num_kv_heads, max_seq_len, block_h=1, block_n=block_n, min_tokens_per_split=128
        )
    dv_pow2 = next_power_of_2(v_head_dim)
    mid_o = q.new_empty((batch, num_q_heads, num_kv_splits, dv_pow2), dtype=torch.float32)
    mid_lse = q.new_empty((batch, num_q_heads, num_kv_splits), dtype=torch.float32)
    dummy = mid_lse
    launch(
        _gqa_decode_stage1, (num_kv_heads, num_kv_splits, batch),
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        sm_scale * _LOG2E, k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1),
        mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        group, head_dim, v_head_dim, num_kv_splits,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=next_power_of_2(head_dim),
        BLOCK_DV=dv_pow2, IS_FP8=is_fp8, UPCAST=INTERPRET_UPCAST,
        num_warps=4, num_stages=1 if is_interpreter() else 2,
    )  # fmt: skip
    out = q.new_empty((batch, num_q_heads, dv_pow2))
    merge_splits(mid_o, mid_lse, out)
    return out[..., :v_head_dim]
