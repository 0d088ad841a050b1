"""Write new KV rows into the token-slot pools, quantizing to FP8 (e4m3) where the pool is FP8,
and read rows of an FP8 pool back in the compute dtype.

One program writes one token's row (all of its heads): `buffer[loc[t]] = rows[t]`, or
`clamp(rows[t] / scale, -FP8_MAX, FP8_MAX)` cast to e4m3 for an FP8 pool with a per-layer scale
(what `engine.kernels.fp8.quantize_fp8` computes). `gather_dequant` is the read: `buffer[slots]
* scale` in fp32, cast to the compute dtype (`engine.kernels.fp8.dequantize_fp8`), in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8
from engine.kernels.launch import launch
from engine.kernels.utils import cdiv, next_power_of_2


@triton.jit
def store_row(dst, x, mask, scale_ptr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Write one row x to dst in the pool's dtype: for an FP8 pool clamp(x / scale) as e4m3
    (what `engine.kernels.fp8.quantize_fp8` computes)."""
    if IS_FP8:
        y = tl.clamp(x.to(tl.float32) / tl.load(scale_ptr), -FP8_MAX, FP8_MAX)
        tl.store(dst, y.to(dst.dtype.element_ty), mask=mask)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _store_rows_kernel(
    src_ptr,  # [T, D] (row stride given, contiguous within a row)
    dst_ptr,  # [num_slots, D] (row stride given)
    loc_ptr,  # [T] slot ids
    scale_ptr,  # [1] fp32 (only when IS_FP8)
    stride_src,
    stride_dst,
    D,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0)
    dblk = tl.program_id(1)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(src_ptr + t.to(tl.int64) * stride_src + offs, mask=mask, other=0.0)
    store_row(dst_ptr + slot * stride_dst + offs, x, mask, scale_ptr, IS_FP8, FP8_MAX)


def _store_rows(
    dst: torch.Tensor, loc: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None
) -> None:
    # dst [num_slots, D] view; src [T, D]; loc [T]
    num_tokens, dim = src.shape
    if num_tokens == 0:
        return
    assert dst.stride(-1) == 1 and src.stride(-1) == 1
    is_fp8 = dst.dtype == FP8_DTYPE
    if is_fp8:
        assert scale is not None, "an fp8 pool needs its scale"
    block_d = min(1024, next_power_of_2(dim))
    grid = (num_tokens, cdiv(dim, block_d))
    launch(
        _store_rows_kernel, grid,
        src, dst, loc, scale if scale is not None else loc, src.stride(0), dst.stride(0), dim,
        BLOCK_D=block_d, IS_FP8=is_fp8, FP8_MAX=FP8_MAX, num_warps=4,
    )  # fmt: skip


def store_mla_kv(
    kv_buffer: torch.Tensor,
    loc: torch.Tensor,
    latent_with_rope: torch.Tensor,
    k_scale: torch.Tensor | None = None,
) -> None:
    """kv_buffer [num_slots, 1, C + R]; loc [T] (out_cache_loc); latent_with_rope [T, C + R]
    (or [T, 1, C + R]). k_scale [1] fp32 is required for an fp8 pool."""
    src = latent_with_rope.reshape(latent_with_rope.shape[0], -1)
    dst = kv_buffer.view(kv_buffer.shape[0], -1)
    _store_rows(dst, loc, src, k_scale)


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """MHA pool: k_buffer [num_slots, Hkv, D], v_buffer [num_slots, Hkv, Dv]; k [T, Hkv, D];
    v [T, Hkv, Dv]; loc [T]."""
    _store_rows(k_buffer.view(k_buffer.shape[0], -1), loc, k.reshape(k.shape[0], -1), k_scale)
    _store_rows(v_buffer.view(v_buffer.shape[0], -1), loc, v.reshape(v.shape[0], -1), v_scale)


@triton.jit(do_not_specialize=["n"])  # rows gathered: a batch-sized count, see launch.py
def _gather_dequant_kernel(
    src_ptr,  # [num_slots, D] e4m3 (row stride given)
    slots_ptr,  # [N] slot ids
    scale_ptr,  # [1] fp32
    out_ptr,  # [N, D] contiguous, the compute dtype
    n,
    stride_src,
    D,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < n
    mask = row_ok[:, None] & (cols < D)[None, :]
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    x = tl.load(src_ptr + slot[:, None] * stride_src + cols[None, :], mask=mask, other=0.0)
    y = x.to(tl.float32) * tl.load(scale_ptr)
    dst = out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=mask)


def gather_dequant(
    buffer: torch.Tensor,
    slots: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    kernel: bool | None = None,
) -> torch.Tensor:
    """`dequantize_fp8(buffer[slots], scale, dtype)`: an FP8 pool's rows at `slots` (any shape)
    in `dtype`, [*slots.shape, *buffer.shape[1:]]. With `kernel` (default: on a GPU, outside
    torch.compile) one Triton kernel reads each row once and writes it once, where the torch
    form is a gather, a cast to fp32, a multiply and a cast: four kernels and two fp32 copies
    (FP8 KV's prefill with a cached prefix ran 2.7% slower than bf16's on an H200, run BA).
    The same bits either way."""
    assert buffer.dtype == FP8_DTYPE and scale.numel() == 1
    if kernel is None:
        kernel = buffer.is_cuda and not torch.compiler.is_compiling()
    if not kernel:
        return dequantize_fp8(buffer[slots], scale, dtype)
    flat = slots.reshape(-1)
    rows = buffer.view(buffer.shape[0], -1)
    assert rows.stride(-1) == 1
    n, dim = flat.numel(), rows.shape[1]
    out = torch.empty(n, dim, dtype=dtype, device=buffer.device)
    if n:
        block_r, block_d = 32, min(128, next_power_of_2(dim))
        launch(
            _gather_dequant_kernel, (cdiv(n, block_r), cdiv(dim, block_d)),
            rows, flat, scale, out, n, rows.stride(0), dim,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out.view(*slots.shape, *buffer.shape[1:])
