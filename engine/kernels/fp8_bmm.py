"""Batched matmul of bf16 activations by FP8 (e4m3) weights with per-output-channel scales.

MLA's absorbed decode multiplies every head's query by W_UK and its attention output by W_UV
(`engine.models.deepseek_v2`): H small GEMMs of a few rows each. At decode sizes the rows are few
and the GEMMs read far more weight bytes than activation bytes, so they are bound by the weight
bandwidth; storing the weights as e4m3 halves those bytes.

out[h, b, n] = scale[h, n] * sum_k x[h, b, k] * w[h, k, n]

The kernel loads e4m3 tiles, converts them in registers to the activations' dtype (exact: every
e4m3 value is a bf16 value), accumulates in fp32 and applies the scales once, after the K loop,
which is where a per-output-channel scale can go: it does not depend on k. Grid: (head, N tile,
B tile); a program reads one [K, BLOCK_N] weight slab of one head once per B tile. The torch
reference is `engine.layers.fp8_bmm.bmm_fp8_native`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fp8 import FP8_DTYPE
from engine.kernels.launch import launch
from engine.kernels.utils import INTERPRET_UPCAST, cdiv, dot, next_power_of_2

# Programs wanted per launch: about one per SM of a large GPU (132 on an H200). N tiles shrink
# until there are this many (or BLOCK_N reaches 16), so that a batch-1 GEMM reads its weights
# with most SMs, not a few.
_TARGET_PROGRAMS = 128


@triton.jit
def _bmm_fp8_kernel(
    x_ptr,  # [H, B, K] activations (strides given)
    w_ptr,  # [H, K, N] e4m3 (strides given)
    scale_ptr,  # [H, N] fp32, contiguous
    out_ptr,  # [H, B, N] (strides given)
    B, K, N,
    stride_xh, stride_xb, stride_xk,
    stride_wh, stride_wk, stride_wn,
    stride_oh, stride_ob, stride_on,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_k = tl.arange(0, BLOCK_K)
    mask_b = offs_b < B
    mask_n = offs_n < N
    x_ptrs = x_ptr + h * stride_xh + offs_b[:, None] * stride_xb + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + h * stride_wh + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mask_b[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += dot(x, w.to(x.dtype), UPCAST)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    scale = tl.load(scale_ptr + h * N + offs_n, mask=mask_n, other=0.0)
    out = (acc * scale[None, :]).to(out_ptr.dtype.element_ty)
    o_ptrs = out_ptr + h * stride_oh + offs_b[:, None] * stride_ob + offs_n[None, :] * stride_on
    tl.store(o_ptrs, out, mask=mask_b[:, None] & mask_n[None, :])


def bmm_fp8(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_b: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """x [H, B, K] (bf16, fp16 or fp32; any strides); w [H, K, N] float8_e4m3fn (any strides,
    e.g. the transpose of a [H, N, K] tensor); scale [H, N] fp32 -> [H, B, N] in x's dtype.

    Written into `out` when given (any strides, e.g. a transposed view into a [B, H, ...]
    buffer), else into a new tensor. The block sizes are tuning knobs (benchmarks); None picks
    them from the shape.
    """
    heads, rows, k_dim = x.shape
    n_dim = w.shape[2]
    assert w.dtype == FP8_DTYPE and w.shape == (heads, k_dim, n_dim), (w.dtype, w.shape)
    assert scale.dtype == torch.float32 and scale.shape == (heads, n_dim) and scale.is_contiguous()
    if out is None:
        out = torch.empty(heads, rows, n_dim, dtype=x.dtype, device=x.device)
    assert out.shape == (heads, rows, n_dim), out.shape
    if rows == 0 or heads == 0:
        return out
    bb = block_b or min(64, max(16, next_power_of_2(rows)))
    bk = block_k or min(128, max(16, next_power_of_2(k_dim)))
    bn = block_n or _pick_block_n(heads, rows, n_dim, bb)
    grid = (heads, cdiv(n_dim, bn), cdiv(rows, bb))
    launch(
        _bmm_fp8_kernel, grid,
        x, w, scale, out, rows, k_dim, n_dim,
        x.stride(0), x.stride(1), x.stride(2),
        w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_B=bb, BLOCK_N=bn, BLOCK_K=bk, UPCAST=INTERPRET_UPCAST, num_warps=4,
    )  # fmt: skip
    return out


def _pick_block_n(heads: int, rows: int, n_dim: int, block_b: int) -> int:
    block_n = min(64, max(16, next_power_of_2(n_dim)))
    b_tiles = cdiv(rows, block_b)
    while block_n > 16 and heads * cdiv(n_dim, block_n) * b_tiles < _TARGET_PROGRAMS:
        block_n //= 2
    return block_n
