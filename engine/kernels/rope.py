"""Rotary position embedding: q [T, H, D] and k [T, Hk, D] rotated in one kernel.

cos/sin are computed in the kernel from the positions and `inv_freq` (fp32, as the torch code
computes them: freqs = position * inv_freq, times the scaled variants' attention factor), then
rounded to the activations' dtype as transformers does before it multiplies. `interleaved`
rotates the pairs (x0, x1), (x2, x3), ... and writes them de-interleaved (evens then odds), as
`engine.layers.rotary` does; otherwise the halves (x[:D/2], x[D/2:]) are rotated.
The jit helpers here are shared with the MLA preamble kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import launch
from engine.kernels.utils import next_power_of_2


@triton.jit
def rope_cos_sin(pos_ptr, t, inv_freq_ptr, offs_j, mask_j, scaling, dtype: tl.constexpr):
    """cos, sin [BLOCK_J] (fp32 values rounded to `dtype`) at token t's position."""
    pos = tl.load(pos_ptr + t).to(tl.float32)
    freqs = pos * tl.load(inv_freq_ptr + offs_j, mask=mask_j, other=0.0)
    cos = (tl.cos(freqs) * scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(freqs) * scaling).to(dtype).to(tl.float32)
    return cos, sin


@triton.jit
def rope_heads(
    src_ptr, dst_ptr, num_heads, stride_sh, stride_dh, cos, sin, offs_j, mask_j, half,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Rotate one token's heads: src [num_heads, 2 * half] (head stride given, from src_ptr)
    -> dst (rotated first halves, then rotated second halves)."""
    if INTERLEAVED:
        i1 = 2 * offs_j
        i2 = 2 * offs_j + 1
    else:
        i1 = offs_j
        i2 = offs_j + half
    for h0 in range(0, num_heads, BLOCK_H):
        offs_h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mask = (offs_h < num_heads)[:, None] & mask_j[None, :]
        src = src_ptr + offs_h[:, None] * stride_sh
        x1 = tl.load(src + i1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + i2[None, :], mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        dst = dst_ptr + offs_h[:, None] * stride_dh + offs_j[None, :]
        tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half, o2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, inv_freq_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    num_q_heads, num_k_heads, half, scaling,
    INTERLEAVED: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_J)
    mask_j = offs_j < half
    cos, sin = rope_cos_sin(pos_ptr, t, inv_freq_ptr, offs_j, mask_j, scaling,
                            q_ptr.dtype.element_ty)  # fmt: skip
    rope_heads(
        q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, num_q_heads, stride_qh, stride_qoh,
        cos, sin, offs_j, mask_j, half, INTERLEAVED, BLOCK_H,
    )  # fmt: skip
    rope_heads(
        k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, num_k_heads, stride_kh, stride_koh,
        cos, sin, offs_j, mask_j, half, INTERLEAVED, BLOCK_H,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, H, D], k [T, Hk, D] (strided views allowed, unit last stride);
    inv_freq [D/2] fp32 -> rotated (q, k), new tensors. q and k share a dtype."""
    assert q.dtype == k.dtype and q.stride(-1) == 1 and k.stride(-1) == 1
    num_tokens, num_q_heads, dim = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if num_tokens == 0:
        return q_out, k_out
    half = dim // 2
    launch(
        _rope_kernel, (num_tokens,),
        q, k, q_out, k_out, positions, inv_freq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        num_q_heads, k.shape[1], half, float(attention_scaling),
        INTERLEAVED=interleaved, BLOCK_J=next_power_of_2(half),
        BLOCK_H=max(2, min(16, next_power_of_2(max(num_q_heads, k.shape[1])))),
        num_warps=4,
    )  # fmt: skip
    return q_out, k_out
