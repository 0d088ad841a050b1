"""MLA's preamble in one kernel: the latent row and the rotated query rope part.

From kv_a_proj_with_mqa's output row [c_kv (kv_lora_rank) | k_pe (rope)] of each token it makes
the row the latent pool stores, [kv_a_layernorm(c_kv) | RoPE(k_pe)], and rotates the query's rope
part q_pe [H, rope] of the same token (one program per token: cos/sin computed once for both).
With `store` (a `PoolRow`: the layer's pool rows, the new tokens' slots and an FP8 pool's
scale) the latent row also goes into the KV pool, quantized as `engine.kernels.kv_store` does,
and the attention backend's `store_kv` (one launch a layer) is skipped; otherwise the backend
stores it.

The rotated q_pe may be written straight into the absorbed query buffer [T, H, C + R] (its last R
columns), so that no concatenation follows. At decode (`mla_preamble_absorb`, a few tokens) the
same launch also applies W_UK to q_nope into that buffer's first C columns, over (C slice,
head, token) programs, so the absorbed query needs no GEMM launch of its own. Rounding as in the
torch code: see `engine.kernels.norm` and `engine.kernels.rope`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.fp8 import FP8_DTYPE, FP8_MAX
from engine.kernels.kv_store import store_row
from engine.kernels.launch import launch
from engine.kernels.norm import rms_norm_row
from engine.kernels.rope import rope_cos_sin, rope_heads
from engine.kernels.utils import cdiv, load_head_slice, next_power_of_2, pdl_wait, row_product

# Tokens up to which `mla_preamble_absorb` serves (a decode step's few rows: each token's
# programs read all of W_UK again, from L2 after the first; timed at one token on the H200).
ABSORB_MAX_TOKENS = 4


class PoolRow(NamedTuple):
    """Where `mla_preamble` stores the latent rows: pool[loc[t]] (pool [num_slots, C + R])."""

    pool: torch.Tensor
    loc: torch.Tensor  # [T] slot ids
    scale: torch.Tensor | None  # [1] fp32 for an FP8 (e4m3) pool


@triton.jit
def _latent_row(
    kv_row, lat_row, w_ptr, t, pool_ptr, loc_ptr, scale_ptr, stride_pool, C, half, eps,
    cos, sin, offs_j, mask_j,
    INTERLEAVED: tl.constexpr, BLOCK_C: tl.constexpr, STORE: tl.constexpr,
    IS_FP8: tl.constexpr, BLOCK_W: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """Token t's latent row [norm(c_kv) | RoPE(k_pe)] from kv_row into lat_row, and with
    STORE into the pool at slot loc[t]."""
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    c = tl.load(kv_row + offs_c, mask=mask_c, other=0.0)
    normed = rms_norm_row(c.to(tl.float32), w_ptr, offs_c, mask_c, C, eps, c.dtype)
    tl.store(lat_row + offs_c, normed.to(lat_row.dtype.element_ty), mask=mask_c)
    # k_pe: one head, rotated into the latent row's last R columns.
    rope_heads(kv_row + C, lat_row + C, 1, 0, 0, cos, sin, offs_j, mask_j, half, INTERLEAVED, 2)
    if STORE:
        # NOTE: the row was written by all of the program's threads: read it back after a
        # barrier, and store it as `_store_rows_kernel` does (the same rounding).
        tl.debug_barrier()
        offs_w = tl.arange(0, BLOCK_W)
        mask_w = offs_w < C + 2 * half
        row = tl.load(lat_row + offs_w, mask=mask_w, other=0.0)
        dst = pool_ptr + tl.load(loc_ptr + t).to(tl.int64) * stride_pool + offs_w
        store_row(dst, row, mask_w, scale_ptr, IS_FP8, FP8_MAX)


@triton.jit
def _mla_preamble_kernel(
    kv_ptr,  # [T, C + R] kv_a_proj_with_mqa output (row stride given)
    q_pe_ptr,  # [T, H, R] (strides given)
    q_out_ptr,  # [T, H, R] (strides given)
    latent_ptr,  # [T, C + R] (row stride given)
    w_ptr,  # [C] kv_a_layernorm weight
    pos_ptr,  # [T]
    inv_freq_ptr,  # [R / 2] fp32
    pool_ptr,  # [num_slots, C + R] (row stride given; STORE)
    loc_ptr,  # [T] slot ids (STORE)
    scale_ptr,  # [1] fp32 (STORE and IS_FP8)
    stride_kv, stride_qt, stride_qh, stride_ot, stride_oh, stride_lat, stride_pool,
    num_heads, C, half, eps, scaling,
    INTERLEAVED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_H: tl.constexpr, STORE: tl.constexpr, IS_FP8: tl.constexpr, BLOCK_W: tl.constexpr,
    FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    offs_j = tl.arange(0, BLOCK_J)
    mask_j = offs_j < half
    cos, sin = rope_cos_sin(pos_ptr, t, inv_freq_ptr, offs_j, mask_j, scaling,
                            q_pe_ptr.dtype.element_ty)  # fmt: skip
    _latent_row(
        kv_ptr + t * stride_kv, latent_ptr + t * stride_lat, w_ptr, t, pool_ptr, loc_ptr,
        scale_ptr, stride_pool, C, half, eps, cos, sin, offs_j, mask_j,
        INTERLEAVED, BLOCK_C, STORE, IS_FP8, BLOCK_W, FP8_MAX,
    )  # fmt: skip
    rope_heads(
        q_pe_ptr + t * stride_qt, q_out_ptr + t * stride_ot, num_heads, stride_qh, stride_oh,
        cos, sin, offs_j, mask_j, half, INTERLEAVED, BLOCK_H,
    )  # fmt: skip


@triton.jit
def _mla_preamble_absorb_kernel(
    kv_ptr,  # [T, C + R] kv_a_proj_with_mqa output (row stride given)
    q_ptr,  # [T, H, NOPE + R]: q_nope then q_pe (strides given)
    w_kc_ptr,  # [H, NOPE, C] (W_UK, strides given)
    q_abs_ptr,  # [T, H, C + R] the absorbed query (strides given)
    latent_ptr,  # [T, C + R] (row stride given)
    w_ptr,  # [C] kv_a_layernorm weight
    pos_ptr,  # [T]
    inv_freq_ptr,  # [R / 2] fp32
    pool_ptr,  # [num_slots, C + R] (row stride given; STORE)
    loc_ptr,  # [T] slot ids (STORE)
    scale_ptr,  # [1] fp32 (STORE and IS_FP8)
    stride_kv, stride_qt, stride_qh, stride_wh, stride_wk, stride_wn, stride_at, stride_ah,
    stride_lat, stride_pool,
    C, half, eps, scaling,
    NOPE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, STORE: tl.constexpr, IS_FP8: tl.constexpr,
    BLOCK_W: tl.constexpr, FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (n, h, t): q_abs[t, h, n-slice] = q_nope[t, h] @ W_UK[h][:, n-slice]; the
    slice-0 programs rotate q_pe[t, h] into q_abs's last R columns, and program (0, 0, t) makes
    token t's latent row. The W_UK slice is loaded before the PDL wait."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)
    offs_k = tl.arange(0, NOPE)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < C
    w_uk = load_head_slice(w_kc_ptr, h, stride_wh, stride_wk, stride_wn, offs_k, offs_n, mask_n)
    pdl_wait(USE_PDL)
    q_row = q_ptr + t * stride_qt + h * stride_qh
    q_abs_row = q_abs_ptr + t * stride_at + h * stride_ah
    y = row_product(tl.load(q_row + offs_k), w_uk)
    tl.store(q_abs_row + offs_n, y.to(q_abs_ptr.dtype.element_ty), mask=mask_n)
    if pid_n == 0:
        offs_j = tl.arange(0, BLOCK_J)
        mask_j = offs_j < half
        cos, sin = rope_cos_sin(pos_ptr, t, inv_freq_ptr, offs_j, mask_j, scaling,
                                q_ptr.dtype.element_ty)  # fmt: skip
        rope_heads(q_row + NOPE, q_abs_row + C, 1, 0, 0, cos, sin, offs_j, mask_j, half,
                   INTERLEAVED, 2)  # fmt: skip
        if h == 0:
            _latent_row(
                kv_ptr + t * stride_kv, latent_ptr + t * stride_lat, w_ptr, t, pool_ptr,
                loc_ptr, scale_ptr, stride_pool, C, half, eps, cos, sin, offs_j, mask_j,
                INTERLEAVED, BLOCK_C, STORE, IS_FP8, BLOCK_W, FP8_MAX,
            )  # fmt: skip


def _pool_args(
    store: PoolRow | None, width: int, num_tokens: int, latent: torch.Tensor, fallback: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], bool]:
    """(pool, loc, scale) kernel arguments (placeholders without `store`), and IS_FP8."""
    if store is None:
        return (latent, fallback, fallback), False
    assert store.pool.shape[-1] == width and store.pool.stride(-1) == 1
    assert store.loc.shape == (num_tokens,)
    is_fp8 = store.pool.dtype == FP8_DTYPE
    assert not is_fp8 or store.scale is not None, "an fp8 pool needs its scale"
    scale = store.scale if store.scale is not None else fallback
    return (store.pool, store.loc, scale), is_fp8


def mla_preamble(
    kv_a: torch.Tensor,
    q_pe: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    interleaved: bool,
    q_pe_out: torch.Tensor | None = None,
    store: PoolRow | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_a [T, C + R]; q_pe [T, H, R]; norm_weight [C]; positions [T]; inv_freq [R / 2] fp32.

    Returns (latent [T, C + R] in kv_a's dtype, rotated q_pe [T, H, R]): the rotated q_pe goes
    into `q_pe_out` when given (any strides with a unit last one, e.g. the last R columns of the
    absorbed query [T, H, C + R]), else into a new tensor. Rows may be strided views. With
    `store`, each latent row is also written to store.pool[store.loc[t]].
    """
    num_tokens, num_heads, rope = q_pe.shape
    width = kv_a.shape[1]
    kv_lora_rank = width - rope
    assert kv_a.stride(1) == 1 and q_pe.stride(2) == 1 and norm_weight.shape == (kv_lora_rank,)
    latent = torch.empty(num_tokens, width, dtype=kv_a.dtype, device=kv_a.device)
    if q_pe_out is None:
        q_pe_out = torch.empty(num_tokens, num_heads, rope, dtype=q_pe.dtype, device=q_pe.device)
    assert q_pe_out.shape == q_pe.shape and q_pe_out.stride(2) == 1
    if num_tokens == 0:
        return latent, q_pe_out
    block_c = next_power_of_2(kv_lora_rank)
    (pool, loc, scale), is_fp8 = _pool_args(store, width, num_tokens, latent, inv_freq)
    launch(
        _mla_preamble_kernel, (num_tokens,),
        kv_a, q_pe, q_pe_out, latent, norm_weight, positions, inv_freq, pool, loc, scale,
        kv_a.stride(0), q_pe.stride(0), q_pe.stride(1), q_pe_out.stride(0), q_pe_out.stride(1),
        latent.stride(0), pool.stride(0), num_heads, kv_lora_rank, rope // 2, eps,
        float(attention_scaling),
        INTERLEAVED=interleaved, BLOCK_C=block_c, BLOCK_J=next_power_of_2(rope // 2),
        BLOCK_H=max(2, min(16, next_power_of_2(num_heads))), STORE=store is not None,
        IS_FP8=is_fp8, BLOCK_W=next_power_of_2(width), FP8_MAX=FP8_MAX,
        num_warps=4 if block_c >= 512 else 2, pdl=True,
    )  # fmt: skip
    return latent, q_pe_out


def mla_preamble_absorb(
    kv_a: torch.Tensor,
    q: torch.Tensor,
    w_kc: torch.Tensor,
    q_abs: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    interleaved: bool,
    store: PoolRow | None = None,
) -> torch.Tensor:
    """`mla_preamble` with W_UK applied in the same launch, for a decode step's few tokens
    (at most ABSORB_MAX_TOKENS): q [T, H, NOPE + R] (q_nope, then q_pe; a strided view of the
    projection's output), w_kc [H, NOPE, C] (W_UK) -> the absorbed query q_abs [T, H, C + R]
    (written: q_nope @ W_UK per head, then the rotated q_pe). Returns the latent rows [T, C + R].
    """
    num_tokens, num_heads, _ = q.shape
    width = kv_a.shape[1]
    nope, c = w_kc.shape[1], w_kc.shape[2]
    rope = width - c
    assert num_tokens <= ABSORB_MAX_TOKENS, num_tokens
    assert q.shape[2] == nope + rope and q.stride(2) == 1 and kv_a.stride(1) == 1
    assert w_kc.shape[0] == num_heads and q_abs.shape == (num_tokens, num_heads, width)
    assert q_abs.stride(2) == 1 and norm_weight.shape == (c,) and nope & (nope - 1) == 0
    latent = torch.empty(num_tokens, width, dtype=kv_a.dtype, device=kv_a.device)
    if num_tokens == 0:
        return latent
    block_n = 64
    (pool, loc, scale), is_fp8 = _pool_args(store, width, num_tokens, latent, inv_freq)
    launch(
        _mla_preamble_absorb_kernel, (cdiv(c, block_n), num_heads, num_tokens),
        kv_a, q, w_kc, q_abs, latent, norm_weight, positions, inv_freq, pool, loc, scale,
        kv_a.stride(0), q.stride(0), q.stride(1), *w_kc.stride(), q_abs.stride(0),
        q_abs.stride(1), latent.stride(0), pool.stride(0), c, rope // 2, eps,
        float(attention_scaling),
        NOPE=nope, INTERLEAVED=interleaved, BLOCK_C=next_power_of_2(c),
        BLOCK_J=next_power_of_2(rope // 2), BLOCK_N=block_n, STORE=store is not None,
        IS_FP8=is_fp8, BLOCK_W=next_power_of_2(width), FP8_MAX=FP8_MAX, num_warps=4, pdl=True,
    )  # fmt: skip
    return latent
