"""RMSNorm, alone or with the residual add fused in front (SGLang/vLLM's `fused_add_rms_norm`).

One program normalises one row. The rounding follows the torch code of `engine.layers.norm` (and
transformers): the residual sum is rounded to the activations' dtype before it is normalised, the
normalised row is rounded to that dtype before the weight multiplies it, so the kernel and the
torch path differ only in the order of the fp32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import launch
from engine.kernels.utils import next_power_of_2, pdl_wait


@triton.jit
def rms_inv(x, N, eps):
    """1 / rms of one row x [BLOCK_N] fp32 (zero where masked) of N values."""
    return tl.rsqrt(tl.sum(x * x, 0) / N + eps)


@triton.jit
def rms_scale_row(x, inv_rms, w_ptr, offs, mask, dtype: tl.constexpr):
    """x fp32 (a row, or a slice of one at offs) -> weight * x * inv_rms in fp32, the
    normalised values rounded to `dtype` first, as the torch code does."""
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    return normed * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def rms_norm_row(x, w_ptr, offs, mask, N, eps, dtype: tl.constexpr):
    """One row x [BLOCK_N] fp32 (zero where masked) -> weight * rms_norm(x) in fp32, the
    normalised row rounded to `dtype` first, as the torch code does."""
    return rms_scale_row(x, rms_inv(x, N, eps), w_ptr, offs, mask, dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    res_ptr,  # [T, N] (HAS_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # [T, N]
    res_out_ptr,  # [T, N] (HAS_RESIDUAL): x + residual
    stride_x, stride_res, stride_out, stride_res_out,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, s, mask=mask)
        x = s.to(tl.float32)
    y = rms_norm_row(x, w_ptr, offs, mask, N, eps, dtype)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as rows [T, N] with unit column stride (a view where possible)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, n)
    res2 = res_out = res_out2 = None
    if residual is not None:
        res2 = _rows(residual)
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(x.shape, dtype=res_dtype, device=x.device)
        res_out2 = res_out.view(-1, n)
    if rows == 0:
        return out, res_out
    block_n = next_power_of_2(n)
    num_warps = min(max(block_n // 256, 1), 8)
    launch(
        _rms_norm_kernel, (rows,),
        x2, res2 if res2 is not None else x2, weight, out2,
        res_out2 if res_out2 is not None else out2,
        x2.stride(0), res2.stride(0) if res2 is not None else 0, out2.stride(0),
        res_out2.stride(0) if res_out2 is not None else 0,
        n, eps, HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=num_warps,
        pdl=True,
    )  # fmt: skip
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] (rows may be strided views), weight [N] -> [..., N]."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., N]; weight [N] -> (rms_norm(x + residual), x + residual).

    Out of place (new tensors), so inputs that other code still reads stay intact.
    """
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None
    return out, res_out
