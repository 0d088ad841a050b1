"""y = x @ W^T + b for a decode step's 1-4 rows, on the CUDA cores: nn.Linear's weight [N, K]
read row by row (each row contiguous), every load of a program issued at once.

At batch 1 cuBLAS runs the dense projections of a V2-Lite layer with 64-column tiles: o_proj
(2048 x 2048, 8.4 MB) on 32 SMs in 5.6-6.1 us (1.4 TB/s), the fused q / kv_a projection
(3648 x 2048) in 6.2-6.6 us. Here one program takes BLOCK_N weight rows over the whole of K (up
to MAX_BLOCK_K columns in one load, so nothing waits on a previous load) and reduces each row
against the few input rows; a 2048-row output spreads over a thousand programs. On an H200, one
row, weights streamed from HBM (`perf/tune_small_gemm.py --gemv-only`): o_proj 4.22 us (1.44x
cuBLAS), the fused q / kv_a projection 5.63 us (1.17x), the first layer's dense down
projection (10944 -> 2048) 13.15 us (1.32x); at 4 rows it was 1.03x and 0.72x, so the engine
sends it one row only (`gemv_wanted`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.launch import launch
from engine.kernels.utils import cdiv, is_interpreter, next_power_of_2, pdl_wait

MAX_ROWS = 4
MAX_BLOCK_K = 4096
# The engine sends one-row GEMMs with weights up to this size here (bigger ones, the LM head,
# keep cuBLAS's bandwidth).
MAX_WEIGHT_BYTES = 64 << 20


class GemvConfig(NamedTuple):
    block_n: int
    num_warps: int


def default_config(n: int, k: int) -> GemvConfig:
    """The best of `perf/tune_small_gemm.py --gemv-only` on an H200 at one row: two weight rows
    a program, one warp (two past MAX_BLOCK_K columns, where K is looped)."""
    if is_interpreter():
        return GemvConfig(4, 1)
    return GemvConfig(2, 1 if k <= MAX_BLOCK_K else 2)


def gemv_wanted(x: torch.Tensor, weight: torch.Tensor, kernel: str = "auto") -> bool:
    """Whether F.linear(x, weight) should run here: one row (at 4 rows it measured no faster
    than cuBLAS, slower for the fused q / kv_a projection), one 16-bit dtype on CUDA
    ("triton" forces it on any device and dtype, for tests; "native" never), contiguous weight
    rows, and a weight of at most MAX_WEIGHT_BYTES (the LM head stays on cuBLAS)."""
    if kernel == "native" or (kernel == "auto" and not x.is_cuda):
        return False
    if torch.compiler.is_compiling() or x.dim() != 2 or x.shape[0] != 1:
        return False
    if x.dtype != weight.dtype or weight.stride(-1) != 1 or x.stride(-1) != 1:
        return False
    if kernel == "auto" and x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return weight.numel() * weight.element_size() <= MAX_WEIGHT_BYTES


@triton.jit
def _gemv_tile(acc, w, x_ptr, k0, offs_k, mask_k, offs_r, stride_xm, ROWS: tl.constexpr):
    """acc [BLOCK_R, BLOCK_N] += the ROWS input rows' columns k0.. against the weight tile w."""
    w = w.to(tl.float32)
    for r in tl.static_range(ROWS):
        x = tl.load(x_ptr + r * stride_xm + k0 + offs_k, mask=mask_k, other=0.0)
        part = tl.sum(w * x.to(tl.float32)[None, :], 1)  # [BLOCK_N]
        acc = tl.where(offs_r[:, None] == r, acc + part[None, :], acc)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] (row stride given)
    w_ptr,  # [N, K] (row stride given)
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N] (row stride given)
    N, K, stride_xm, stride_wn, stride_ym,
    ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Program n: y[:, n-slice], each weight row's dot with each of the ROWS input rows. The
    first weight tile (all of K up to BLOCK_K) is loaded before the PDL wait, while the kernel
    before this one still runs."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    mask_k = offs_k < K
    w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    acc = _gemv_tile(acc, w, x_ptr, 0, offs_k, mask_k, offs_r, stride_xm, ROWS)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        mask_k = offs_k < K - k0
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = _gemv_tile(acc, w, x_ptr, k0, offs_k, mask_k, offs_r, stride_xm, ROWS)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_r[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_r < ROWS)[:, None] & mask_n)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], M <= MAX_ROWS; weight [N, K] with contiguous
    rows; the result in x's dtype (into `out` [M, N] when given, rows contiguous)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.stride(1) == 1 and x.stride(1) == 1
    assert m <= MAX_ROWS, f"gemv takes at most {MAX_ROWS} rows, got {m}"
    if out is None:
        out = x.new_empty(m, n)
    assert out.shape == (m, n) and out.stride(1) == 1
    if m == 0:
        return out
    cfg = config or default_config(n, k)
    launch(
        _gemv_kernel, (cdiv(n, cfg.block_n),),
        x, weight, bias if bias is not None else weight, out, n, k, x.stride(0),
        weight.stride(0), out.stride(0),
        ROWS=m, HAS_BIAS=bias is not None, BLOCK_R=max(2, next_power_of_2(m)),
        BLOCK_N=cfg.block_n, BLOCK_K=min(MAX_BLOCK_K, max(16, next_power_of_2(k))),
        num_warps=cfg.num_warps, pdl=True,
    )  # fmt: skip
    return out
