"""Per-head GEMMs of a decode step's few rows: out[h] = x[h] @ w[h] for M <= 16 rows.

MLA's absorbed weights at decode are 16 small GEMMs each (W_UK: [T, 128] @ [128, 512] per head,
W_UV: [T, 512] @ [512, 128]), 2 MB of weights in all. cuBLAS's batched GEMM took 3.3 and 3.7 us
for them on an H200; this kernel (one program per head and BLOCK_N slice of the output, the
weight tile pipelined over K, M padded to a 16-row tile) 2.85 and 3.35 us, streaming from HBM
(perf/tune_small_gemm.py; perf/RESULTS.md, "Small-M GEMMs of a decode step").
The same kernel on the dense projections (the fused q / kv_a projection, o_proj) was slower
than cuBLAS at 1-16 rows (7.2 against 6.5 us, 6.4 against 6.0 us), so those stay on cuBLAS.

`small_matmul(x, w, out)` takes any strides: W_UK as stored [H, K, N], W_UV as a transposed
view of its [H, N, K], the output a strided view of the absorbed query buffer. At 1-4 tokens
the engine applies both inside other launches instead (W_UK in `mla_preamble_absorb`, W_UV with
the split merge in `mla_decode`'s value projection), so this serves 5-16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.launch import launch
from engine.kernels.utils import (
    INTERPRET_UPCAST,
    cdiv,
    contiguous_span,
    dot,
    is_interpreter,
    line_elements,
    pdl_wait,
    prefetch_span_l2,
)

MAX_ROWS = 16  # one BLOCK_M tile


class SmallGemmConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_config(n: int, k: int) -> SmallGemmConfig:
    """The best tiles of `perf/tune_small_gemm.py` on an H200 at 1, 4 and 16 rows: W_UK
    (K 128, N 512) and W_UV (K 512, N 128) of V2-Lite's 16 heads."""
    if is_interpreter():
        return SmallGemmConfig(16, 32, 4, 1)
    if n >= 512:
        return SmallGemmConfig(64, 64, 4, 3)
    return SmallGemmConfig(32, 128, 4, 4)


@triton.jit(do_not_specialize=["M"])
def _small_gemm_kernel(
    x_ptr,  # [B, M, K] (strides given)
    w_ptr,  # [B, K, N] (strides given)
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [B, M, N] (strides given)
    M, N, K,
    stride_xb, stride_xm, stride_xk,
    stride_wb, stride_wk, stride_wn,
    stride_yb, stride_ym, stride_yn,
    prefetch_numel,  # USE_PDL: the weight's span, prefetched by the grid before the wait (0: none)
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, LINE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (n, b): y[b, :, n-slice] over the whole of K (fp32 accumulation)."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if USE_PDL:
        num_n = tl.num_programs(0)
        pid = b * num_n + pid_n
        prefetch_span_l2(w_ptr, prefetch_numel, pid, num_n * tl.num_programs(1), LINE, 32)
    pdl_wait(USE_PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_ptrs = x_ptr + b * stride_xb + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + b * stride_wb + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += dot(a, w, UPCAST)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + b * stride_yb + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def small_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: SmallGemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ w [K, N] (or batched: [B, M, K] @ [B, K, N]) -> [(B,) M, N] in x's dtype,
    written into `out` when given (any strides); `bias` [N] (2-D only). M <= MAX_ROWS."""
    batched = x.dim() == 3
    x3, w3 = (x, w) if batched else (x.unsqueeze(0), w.unsqueeze(0))
    nb, m, k = x3.shape
    n = w3.shape[2]
    assert w3.shape == (nb, k, n), (x.shape, w.shape)
    assert m <= MAX_ROWS, f"small_matmul takes at most {MAX_ROWS} rows, got {m}"
    assert bias is None or (not batched and bias.shape == (n,))
    if out is None:
        out = x.new_empty((nb, m, n) if batched else (m, n))
    y3 = out if batched else out.unsqueeze(0)
    assert y3.shape == (nb, m, n), (out.shape, (nb, m, n))
    if m == 0:
        return out
    cfg = config or default_config(n, k)
    launch(
        _small_gemm_kernel, (cdiv(n, cfg.block_n), nb),
        x3, w3, bias if bias is not None else x3, y3, m, n, k,
        *x3.stride(), *w3.stride(), *y3.stride(), contiguous_span(w3),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        UPCAST=INTERPRET_UPCAST, LINE=line_elements(w3), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, pdl=True,
    )  # fmt: skip
    return out


def small_gemm_wanted(x: torch.Tensor, w: torch.Tensor, kernel: str = "auto") -> bool:
    """Whether the kernel should run the per-head x [H, M, K] @ w [H, K, N]: few rows, one
    dtype, 16-bit on CUDA ("auto"); "triton" forces it (fp32 too, any device, for tests),
    "native" never takes it. A compiled forward keeps torch.bmm (inductor's own choice)."""
    if kernel == "native" or (kernel == "auto" and not x.is_cuda):
        return False
    if torch.compiler.is_compiling() or x.dim() != 3 or x.shape[1] > MAX_ROWS:
        return False
    if x.dtype != w.dtype:
        return False
    return kernel == "triton" or x.dtype in (torch.bfloat16, torch.float16)
