"""Grouped MLA decode attention (split-KV, two stages) over the latent KV pool.

After weight absorption every query head attends to the same latent KV row
(`kv_lora_rank` latent + `qk_rope_head_dim` rope = 576 for DeepSeek), so one program takes a
*group* of query heads and each KV tile it loads is used by the whole group. The context is cut
into `num_kv_splits` pieces (stage 1, one program per (head group, split, request)); stage 2
merges the partial outputs with their log-sum-exp. The split count is picked from batch, heads
and context so that small batches still fill the GPU. With `value_proj` (MLA's W_UV) the output
is projected per head too; at a few requests stage 2 does that in the same launch.

Slots are read through a table: `req_to_token` (page size 1, one slot id per position) or a
FlashMLA-style `block_table` (page size 64, one page id per 64 positions). With FP8 (e4m3)
caches QK can run as an e4m3 tensor-core dot (`MLADecodeConfig.fp8_dots`: q quantized in the
kernel, the tile's tokens as M); V, and the whole tile without it, is converted to fp16 in
registers right after the load. The per-layer scale folds into the softmax scale for QK and into
the output for PV.
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels import mla_decode_gluon, mla_decode_gluon_wide
from engine.kernels.launch import launch
from engine.kernels.small_gemm import small_gemm_wanted, small_matmul
from engine.kernels.utils import (
    INTERPRET_UPCAST,
    cdiv,
    choose_num_kv_splits,
    dot,
    has_fp8_cvt,
    is_interpreter,
    load_head_slice,
    merge_blocks,
    merge_row,
    merge_splits,
    next_power_of_2,
    num_sms,
    online_softmax_step,
    pdl_wait,
    row_product,
    split_bounds,
    store_split,
)

_LOG2E = 1.4426950408889634
# Batches up to this size merge the splits and apply the value projection in one kernel
# (`merge_project_wanted`). Each request's programs read the whole weight again (from L2 after
# the first), and each head's splits are merged once per value slice, so larger batches, more
# heads (128: 16 MB of partial outputs a request at 64 splits) and more splits go back to the
# merge cut by columns and one GEMM. On an H100 at 16 heads (perf/RESULTS.md, runs AQ and AR,
# `perf/bench_value_proj.py`) the one kernel is 1.01-1.95x the merge and GEMM at batch 1-4 up
# to 33 splits, and 0.74x at batch 1 with 64 splits (ctx 16K).
MERGE_PROJECT_MAX_ROWS = 4
MERGE_PROJECT_MAX_HEADS = 16
MERGE_PROJECT_MAX_SPLITS = 48
# The split merge inside the 16-head Gluon kernel (`MLADecodeConfig.merge_inside`) serves calls
# of at most this many splits whose grid fits the SMs: on an H100 (perf/RESULTS.md, run AS) it
# took 0.2-1.9 us off the call at 2-16 splits and cost 0.8-1.1 us at 64 (batch 1, 64 programs
# on one counter).
MERGE_INSIDE_MAX_SPLITS = 16
# Whether the engine's pick (`gluon_config`) merges inside. Off: the kernel alone is faster, but
# the value projection after it then starts while stage 1 runs (PDL), prefetching W_UV among
# stage 1's loads, and the pair was 2.4-4.9 us slower than stage 1, merge and projection on an
# H200 (without PDL -1.2 to +1.6 us); the engine's decode 1.0-1.7% slower at 16 requests, ctx
# 4K (runs AS, AT). `perf/bench_engine.py --merge-inside` turns it on for a run.
GLUON_MERGE_INSIDE = False
# 2: every launch of the 16/32-head Gluon kernel at page size 1 reads slot ids two tiles ahead
# (`MLADecodeConfig.slots_ahead` 2 for all); `perf/bench_engine.py --slots-ahead2` sets it for
# a run. On an H100 (run BB) 5-10% faster with the cache held in L2, level to 4% slower from
# HBM, level in the engine; not timed on an H200 (where run BA's FP8 call at page size 1 was
# 1.04-1.09x the paged one at batch 64-128, ctx 4K-16K).
GLUON_SLOTS_AHEAD = 1
# True: the 16-head FP8 Gluon kernel reading V into registers (`pv_regs`) takes q as one e4m3
# term (FlashMLA FP8's quantization of q) instead of two: half the QK wgmmas' width, 3-4% off
# the call held in L2 on an H100, 7.8e-3 from the two-term output (run BB, `regs4q1`); an
# H200 candidate with GLUON_SLOTS_AHEAD 2 for the 1.6x line. `perf/bench_kernels.py
# --q-one-term` sets it for a run.
GLUON_Q_ONE_TERM = False


@triton.jit
def _page_slots(table_row, n, offs_t, end, PAGE_SIZE: tl.constexpr, SLOT_TABLE: tl.constexpr):
    """Slot ids of tokens n + offs_t (0 past `end`). A tile never crosses a page, so its slots
    follow the first one: read from the slot table (SLOT_TABLE) or made from the page id."""
    if SLOT_TABLE:
        slots = tl.load(table_row + n, mask=n < end, other=0).to(tl.int64) + offs_t
    else:
        page = tl.load(table_row + n // PAGE_SIZE, mask=n < end, other=0).to(tl.int64)
        slots = page * PAGE_SIZE + (n + offs_t) % PAGE_SIZE
    return slots


@triton.jit
def _tile_slots(table_row, n, offs_t, end, PAGE_SIZE: tl.constexpr, SLOT_TABLE: tl.constexpr):
    """Slot ids of the tile at n (0 past `end`): one id per token at page size 1, else made
    from the tile's page (`_page_slots`)."""
    if PAGE_SIZE == 1:
        slots = tl.load(table_row + n + offs_t, mask=n + offs_t < end, other=0)
    else:
        slots = _page_slots(table_row, n, offs_t, end, PAGE_SIZE, SLOT_TABLE)
    return slots


@triton.jit
def _load_tile(
    kv_ptr, slot, mask_n, offs_c, offs_r, stride_kv, C: tl.constexpr, HALVES: tl.constexpr
):  # fmt: skip
    """The latent and RoPE [BLOCK_N, R] parts of the rows at `slot`: the latent whole
    [BLOCK_N, C], or with HALVES its two halves [BLOCK_N, C / 2] (offs_c spans one half;
    without HALVES the second one returned is the first again)."""
    kv_rows = kv_ptr + slot.to(tl.int64)[:, None] * stride_kv
    kv = tl.load(kv_rows + offs_c[None, :], mask=mask_n[:, None], other=0.0)
    if HALVES:
        kv_hi = tl.load(kv_rows + C // 2 + offs_c[None, :], mask=mask_n[:, None], other=0.0)
    else:
        kv_hi = kv
    pe = tl.load(kv_rows + C + offs_r[None, :], mask=mask_n[:, None], other=0.0)
    return kv, kv_hi, pe


@triton.jit
def _e4m3_to_f16(x, USE_PTX: tl.constexpr):
    """e4m3 -> fp16 (exact), converted in the layout the tile was loaded in."""
    if USE_PTX:
        # NOTE: a non-pure inline asm, because Triton moves a plain `.to()` past the layout
        # change into the MMA operand layout, where an 8-bit tile is read from shared memory
        # byte by byte (ld.shared.b8) to transpose V. Converted here, the tile is stored to
        # shared memory once as fp16 and both dots read it with ldmatrix (V with .trans):
        # 1.4x faster on an H200 at batch 64, context 16384.
        y = tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            constraints="=r,=r,r",
            args=[x],
            dtype=tl.float16,
            is_pure=False,
            pack=4,
        )
    else:
        y = x.to(tl.float16)
    return y


@triton.jit
def _scale_q(q, q_mul, q_dtype: tl.constexpr, RESIDUAL: tl.constexpr):
    """q * q_mul in q_dtype and, with RESIDUAL, its rounding error times 16 in q_dtype too
    (e4m3 keeps 3 mantissa bits; the two terms together about 7)."""
    x = q.to(tl.float32) * q_mul
    y = x.to(q_dtype)
    r = y
    if RESIDUAL:
        r = ((x - y.to(tl.float32)) * 16.0).to(q_dtype)
    return y, r


@triton.jit
def _paired_q(q_ptrs, mask, q_mul):
    """q's two e4m3 terms (`_scale_q`) as the rows of one operand, from q's rows loaded twice
    each: [2M, K] with rows y0, r0, y1, r1, ...

    NOTE: built with a `where` on the row's parity; the same rows from `tl.join` + permute +
    reshape are right under the interpreter but wrong on an H200 (Triton 3.6)."""
    y, r = _scale_q(tl.load(q_ptrs, mask=mask, other=0.0), q_mul, tl.float8e4nv, True)
    odd = tl.arange(0, y.shape[0]) % 2 == 1
    return tl.where(odd[:, None], r, y)


@triton.jit
def _mla_decode_stage1(
    q_ptr,  # [B, H, C + R]
    kv_ptr,  # [num_slots, C + R] (row stride given)
    table_ptr,  # [rows, cols] int32: slot ids per position (SLOT_TABLE) or page ids
    row_idx_ptr,  # [B] table row per request (only when HAS_ROW_IDX)
    seq_lens_ptr,  # [B]
    mid_o_ptr,  # [B, H, S, C] fp32, or the output [B, H, 1, C] when S == 1
    mid_lse_ptr,  # [B, H, S] fp32 (log2 units)
    qk_scale,  # sm_scale * log2(e) (times k_scale for fp8 is applied in-kernel)
    k_scale_ptr,  # [1] fp32 (only when IS_FP8)
    stride_qb,
    stride_qh,
    stride_kv,
    stride_table,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    num_heads,
    num_splits,
    C: tl.constexpr,  # kv_lora_rank (power of two)
    R: tl.constexpr,  # rope dim (power of two)
    PAGE_SIZE: tl.constexpr,
    SLOT_TABLE: tl.constexpr,  # the table holds every position's slot (req_to_token)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ROW_IDX: tl.constexpr,
    IS_FP8: tl.constexpr,
    USE_PTX: tl.constexpr,  # fp8: convert with inline PTX (sm_89+), else with `.to`
    UPCAST: tl.constexpr,
    SLOTS_AHEAD: tl.constexpr,  # slot (page) ids one tile ahead, or with their tile
    HALVES: tl.constexpr,  # the latent's two halves as separate dots (two MMA chains)
    FP8_DOTS: tl.constexpr,  # fp8: q in e4m3, QK as an e4m3 dot with the tile's tokens as M
    Q_RESIDUAL: tl.constexpr,  # FP8_DOTS: q's e4m3 rounding error as a second e4m3 term
    Q_PAIRS: tl.constexpr,  # Q_RESIDUAL: both terms through one dot (rows paired)
    USE_PDL: tl.constexpr = False,
):
    """One (head group, split, request): online softmax over the split's KV tiles. Before the
    PDL wait it reads only the step's inputs (lengths, slot table); q and the newest latent row
    were written by the launches just before."""
    # NOTE: the head group is the fastest grid axis, so programs that share a KV tile run
    # side by side and the re-reads of a tile (heads > BLOCK_H) mostly hit L2.
    hg = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    row, start, end = split_bounds(
        seq_lens_ptr, row_idx_ptr, b, split, num_splits, HAS_ROW_IDX, BLOCK_N
    )

    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, C // 2 if HALVES else C)
    offs_r = tl.arange(0, R)
    offs_t = tl.arange(0, BLOCK_N)
    table_row = table_ptr + row * stride_table
    # NOTE: with SLOTS_AHEAD the next tile's slot (page) ids are read one iteration ahead, so
    # the KV loads never wait on an index load issued in the same iteration; without it they
    # are read with their tile and Triton's pipeliner places them (`resolve_slots_ahead`).
    if SLOTS_AHEAD:
        next_slot = _tile_slots(table_row, start, offs_t, end, PAGE_SIZE, SLOT_TABLE)
    else:
        next_slot = tl.zeros([BLOCK_N], dtype=tl.int32)
    pdl_wait(USE_PDL)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_base + offs_c[None, :], mask=mask_h[:, None], other=0.0)
    q_hi = q_nope
    if HALVES:
        q_hi = tl.load(q_base + C // 2 + offs_c[None, :], mask=mask_h[:, None], other=0.0)
    q_pe = tl.load(q_base + C + offs_r[None, :], mask=mask_h[:, None], other=0.0)

    scale = qk_scale
    out_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        scale = scale * k_scale
        out_scale = k_scale
        amax = tl.maximum(
            tl.max(tl.abs(q_nope.to(tl.float32))), tl.max(tl.abs(q_pe.to(tl.float32)))
        )
        if HALVES:
            amax = tl.maximum(amax, tl.max(tl.abs(q_hi.to(tl.float32))))
        if FP8_DOTS:
            # q in e4m3 with one scale for this token's heads of the group, which folds into
            # the softmax scale with k_scale.
            q_mul = 448.0 / tl.maximum(amax, 1e-30)
            q_dtype = tl.float8e4nv
        else:
            # The dots run in fp16: q is scaled down by a power of two where it would overflow.
            q_mul = tl.exp2(tl.minimum(14.0 - tl.ceil(tl.log2(tl.maximum(amax, 1e-30))), 0.0))
            q_dtype = tl.float16
        # The residuals of these rows serve the two-dot form; Q_PAIRS builds its own below.
        two_dots = Q_RESIDUAL and not Q_PAIRS
        q_nope, r_nope = _scale_q(q_nope, q_mul, q_dtype, two_dots)
        q_hi, r_hi = _scale_q(q_hi, q_mul, q_dtype, two_dots)
        q_pe, r_pe = _scale_q(q_pe, q_mul, q_dtype, two_dots)
        scale = scale / q_mul
        if Q_PAIRS:
            offs_h2 = hg * BLOCK_H + tl.arange(0, 2 * BLOCK_H) // 2
            q2_base = q_ptr + b.to(tl.int64) * stride_qb + offs_h2[:, None] * stride_qh
            mask_h2 = (offs_h2 < num_heads)[:, None]
            pq_nope = _paired_q(q2_base + offs_c[None, :], mask_h2, q_mul)
            pq_hi = pq_nope
            if HALVES:
                pq_hi = _paired_q(q2_base + C // 2 + offs_c[None, :], mask_h2, q_mul)
            pq_pe = _paired_q(q2_base + C + offs_r[None, :], mask_h2, q_mul)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, C // 2 if HALVES else C], dtype=tl.float32)
    acc_hi = acc
    for n in range(start, end, BLOCK_N):
        offs_n = n + offs_t
        mask_n = offs_n < end
        if SLOTS_AHEAD:
            slot = next_slot.to(tl.int64)
            next_slot = _tile_slots(table_row, n + BLOCK_N, offs_t, end, PAGE_SIZE, SLOT_TABLE)
        elif PAGE_SIZE == 1:
            slot = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)
        elif SLOT_TABLE:
            slot = tl.load(table_row + n).to(tl.int64) + offs_t
        else:
            page = tl.load(table_row + n // PAGE_SIZE).to(tl.int64)
            slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
        kv, kv_hi, pe = _load_tile(kv_ptr, slot, mask_n, offs_c, offs_r, stride_kv, C, HALVES)
        if FP8_DOTS:
            # NOTE: the scores come transposed, [BLOCK_N, BLOCK_H]: with the tile's tokens as
            # M (64) QK is a Hopper wgmma on e4m3 operands read straight from the tile's
            # shared-memory copy; with heads as M (16) it would be an mma.sync, which Triton
            # runs in fp16 after converting both operands. PV stays an fp16 mma.sync with heads
            # as M: an e4m3 PV needs V transposed byte by byte in shared memory (3.5-8x slower
            # on an H200), and a wgmma with the latent as M was slower than this (run AH).
            if Q_PAIRS:
                # NOTE: the two q terms as the rows of one [2 * BLOCK_H, ...] operand (h0, r0,
                # h1, r1, ...): one m64n32 wgmma chain instead of two m64n16 ones (18 wgmma a
                # tile against 36, the waits of one term), and each thread's accumulator holds
                # a head's two columns, so the split is free (run AI: 0.91-1.18x two dots).
                s2 = dot(kv, tl.trans(pq_nope), UPCAST)
                if HALVES:
                    s2 += dot(kv_hi, tl.trans(pq_hi), UPCAST)
                s2 += dot(pe, tl.trans(pq_pe), UPCAST)
                main, res = tl.split(tl.reshape(s2, (BLOCK_N, BLOCK_H, 2)))
                qk_t = main + res * (1.0 / 16.0)
            else:
                qk_t = dot(kv, tl.trans(q_nope), UPCAST)
                if HALVES:
                    qk_t += dot(kv_hi, tl.trans(q_hi), UPCAST)
                qk_t += dot(pe, tl.trans(q_pe), UPCAST)
                if Q_RESIDUAL:
                    qk_r = dot(kv, tl.trans(r_nope), UPCAST)
                    if HALVES:
                        qk_r += dot(kv_hi, tl.trans(r_hi), UPCAST)
                    qk_r += dot(pe, tl.trans(r_pe), UPCAST)
                    qk_t = qk_t + qk_r * (1.0 / 16.0)
            qk_t = tl.where(mask_n[:, None], qk_t * scale, float("-inf"))
            # The softmax step along the tile's tokens (axis 0); only p is transposed for PV.
            p_t, alpha, m_i, l_i = online_softmax_step(qk_t, m_i, l_i, 0)
            p = tl.trans(p_t).to(tl.float16)
            # NOTE: each half converted right before its dot: the two fp16 copies then share
            # shared memory (2 stages: 83 KB a program with one q term, 92 KB with two, two
            # programs an SM; 115 KB if both halves are converted first).
            acc = acc * alpha[:, None] + dot(p, _e4m3_to_f16(kv, USE_PTX), UPCAST)
            if HALVES:
                acc_hi = acc_hi * alpha[:, None] + dot(p, _e4m3_to_f16(kv_hi, USE_PTX), UPCAST)
        else:
            if IS_FP8:
                kv = _e4m3_to_f16(kv, USE_PTX)
                pe = _e4m3_to_f16(pe, USE_PTX)
                if HALVES:
                    kv_hi = _e4m3_to_f16(kv_hi, USE_PTX)
            if HALVES:
                # NOTE: each half is scaled before the two are added: Triton folds `dot + x`
                # into one dot accumulating onto x, which would chain all 36 k-steps of a
                # warp's MMAs again (the QK latency at 16 heads, where a warp owns one 16 x 8
                # score tile).
                qk_lo = dot(q_nope, tl.trans(kv), UPCAST)
                qk_hi = dot(q_hi, tl.trans(kv_hi), UPCAST)
                qk_hi += dot(q_pe, tl.trans(pe), UPCAST)
                qk = qk_lo * scale + qk_hi * scale
            else:
                qk = dot(q_nope, tl.trans(kv), UPCAST)
                qk += dot(q_pe, tl.trans(pe), UPCAST)
                qk = qk * scale
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_step(qk, m_i, l_i)
            acc = acc * alpha[:, None] + dot(p.to(kv.dtype), kv, UPCAST)
            if HALVES:
                acc_hi = acc_hi * alpha[:, None] + dot(p.to(kv.dtype), kv_hi, UPCAST)

    store_split(
        mid_o_ptr, mid_lse_ptr, acc, m_i, l_i, out_scale, b, split, offs_h, mask_h, offs_c, None,
        stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, end > start,
    )  # fmt: skip
    if HALVES:
        store_split(
            mid_o_ptr, mid_lse_ptr, acc_hi, m_i, l_i, out_scale, b, split, offs_h, mask_h,
            C // 2 + offs_c, None, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
            end > start,
        )  # fmt: skip


@triton.jit
def _merge_project_kernel(
    mid_o_ptr,  # [B, H, S, C] fp32
    mid_lse_ptr,  # [B, H, S] fp32
    w_ptr,  # [H, C, V] (strides given)
    y_ptr,  # [B, H, V] (strides given)
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    stride_wh, stride_wc, stride_wv, stride_yb, stride_yh,
    num_splits, V,
    C: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_SA: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (value slice, head, request): the head's splits merged (`merge_row`), rounded to
    the output dtype as the merged output would be, times its slice of w. The weight slice is
    loaded before the PDL wait, while stage 1 runs."""
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    w = load_head_slice(w_ptr, h, stride_wh, stride_wc, stride_wv, offs_c, offs_v, mask_v)
    pdl_wait(USE_PDL)
    x = merge_row(
        mid_o_ptr + b * stride_mob + h * stride_moh, mid_lse_ptr + b * stride_mlb + h * stride_mlh,
        num_splits, stride_mos, offs_c, BLOCK_S, BLOCK_SA,
    )  # fmt: skip
    y = row_product(x.to(y_ptr.dtype.element_ty), w)
    y_ptrs = y_ptr + b * stride_yb + h * stride_yh + offs_v
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_v)


def _merge_project(
    mid_o: torch.Tensor, mid_lse: torch.Tensor, w: torch.Tensor, y: torch.Tensor
) -> None:
    """y [B, H, V] = merge_splits(mid_o, mid_lse) [B, H, C] @ w [H, C, V] per head."""
    batch, num_heads, num_splits, c = mid_o.shape
    v = w.shape[2]
    block_v = 16
    block_s, block_sa = merge_blocks(num_splits, c)
    launch(
        _merge_project_kernel, (cdiv(v, block_v), num_heads, batch),
        mid_o, mid_lse, w, y, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), *w.stride(), y.stride(0), y.stride(1),
        num_splits, v, C=c, BLOCK_V=block_v, BLOCK_S=block_s, BLOCK_SA=block_sa,
        num_warps=4, pdl=True,
    )  # fmt: skip


def _project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, H, C] @ w [H, C, V] per head -> [B, H, V] (the small-M kernel where it serves)."""
    y = x.new_empty(x.shape[0], x.shape[1], w.shape[2])
    if small_gemm_wanted(x.transpose(0, 1), w):
        small_matmul(x.transpose(0, 1), w, out=y.transpose(0, 1))
    else:
        torch.bmm(x.transpose(0, 1), w, out=y.transpose(0, 1))
    return y


def merge_project_wanted(batch: int, num_heads: int, num_kv_splits: int) -> bool:
    """Whether the split merge and the value projection run as one kernel (`_merge_project`)
    rather than `merge_splits` and then `_project`: the MERGE_PROJECT_* limits above."""
    return (
        1 < num_kv_splits <= MERGE_PROJECT_MAX_SPLITS
        and batch <= MERGE_PROJECT_MAX_ROWS
        and num_heads <= MERGE_PROJECT_MAX_HEADS
    )


def merge_inside_fits(num_kv_splits: int, programs: int, sms: int | None = None) -> bool:
    """Whether stage 1 may merge its splits itself (`mla_decode_gluon._merge_here`): 2 to
    MERGE_INSIDE_MAX_SPLITS splits, and a grid no larger than the SMs, so that every program is
    resident while they wait for each other."""
    sms = sms if sms is not None else num_sms()
    return 1 < num_kv_splits <= MERGE_INSIDE_MAX_SPLITS and programs <= sms


class MLADecodeConfig(NamedTuple):
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    waves: float = 2.0  # split count aims at this many programs per SM
    min_split_tokens: int = 256
    # Slot ids (page ids with pages) read one tile ahead, into registers (1), or with their
    # tile, the indirect load left to Triton's pipeliner (0); None: `resolve_slots_ahead`.
    # 2: the loader of the 16/32-head Gluon kernel (FP8 or bf16; not the 64-head one) reads
    # them two tiles ahead at page size 1 (opt-in, `GLUON_SLOTS_AHEAD`; with pages, in the
    # wide kernel and in the Triton kernel it means 1).
    slots_ahead: int | None = None
    # The latent's two halves as separate QK and PV dots: two independent MMA chains a warp
    # instead of one of 36 steps (576 / 16) per score tile.
    halves: bool = False
    # fp8 caches: q quantized to e4m3 in the kernel and QK as an e4m3 tensor-core dot (sm_89+,
    # a latent (half) and RoPE part of at least 32); PV stays fp16. Off: both dots in fp16.
    fp8_dots: bool = False
    # With fp8_dots: q's e4m3 rounding error as a second e4m3 term (a second QK dot). One term
    # alone doubled the output error against the fp16 dots (3-4e-2, FlashMLA FP8's level)
    # and was about 10% faster at long contexts on an H200 (run AH).
    q_residual: bool = False
    # With q_residual: the two terms as the paired rows of one dot operand (h0, r0, h1, ...),
    # one wgmma chain of twice the width instead of two: 1.02-1.18x the two dots at batch 16
    # and above past 1K of context on an H200, 0.91-1.00x at batch 1 (run AI).
    q_pairs: bool = False
    # fp8 caches on Hopper: the warp-specialized Gluon kernel (`mla_decode_gluon`; block_h 16,
    # block_n 64, num_stages e4m3 tiles in flight) with this many fp16 V tiles in flight (0:
    # the Triton kernel). q_residual picks one or two e4m3 terms of q; the other flags are
    # the Triton kernel's. 16-bit caches on Hopper: any nonzero value takes the Gluon kernel
    # (num_stages tiles in flight; 2 at a latent of 512), of 64 heads a program
    # (`mla_decode_gluon_wide`) with gluon_heads 64, else of 16 (no converter, V read from the
    # ring).
    gluon: int = 0
    # With gluon: the tokens of one fp16 V ring slot (64, 32 or 16: a tile's V in 1, 2 or 4
    # slots, PV run and each slot released a slot at a time).
    v_rows: int = 64
    # With gluon: heads a program, 16 or 32 (N of its wgmmas; 32 halves the programs that
    # read each tile at 128 heads, and needs V slots of 32 tokens to fit), or 64: the kernel
    # of 64 heads a program (`mla_decode_gluon_wide`, num_stages e4m3 tiles, q_residual as for
    # the others; `gluon_config` takes it for wide calls where the shape allows, else 32).
    gluon_heads: int = 16
    # With gluon (the FP8 kernel, 16 or 32 heads a program): PV as an e4m3 wgmma, V written
    # transposed in e4m3 (`mla_decode_gluon._transposer`: half the shared-memory traffic of
    # the fp16 copy, bank-conflict free) and P in e4m3; gluon V^T slots of a whole tile
    # (v_rows 64). Opt-in: 1.02-1.07x the fp16 PV at batch 1-16 on an H100, but P's e4m3
    # rounding moved the engine's logits 3.6-3.8% of their scale (run AN, perf/RESULTS.md).
    pv_e4m3: bool = False
    # With gluon (16 heads a program): the split merge inside stage 1 where the grid fits the
    # SMs and the splits are few (`mla_decode_gluon._merge_here`, MERGE_INSIDE_MAX_SPLITS)
    # instead of `merge_splits` after it.
    merge_inside: bool = False
    # With gluon (the FP8 kernel, 16 heads a program): PV with V^T read from the e4m3 ring into
    # the attention warp group's registers, turned to fp16 there and fed to the wgmma as its A
    # operand (`mla_decode_gluon._pv_regs_step`): no converter warps and no fp16 V ring, so
    # num_stages e4m3 tiles (2-5) fill the shared memory; `gluon` and v_rows unused. With
    # pv_e4m3 too: PV as e4m3 wgmmas on those registers (`_pv8_regs_tile`: half the PV wgmmas,
    # no V conversion, P in e4m3 as pv_e4m3 rounds it); opt-in: on an H100 level from HBM
    # and 1-8% slower in L2, the loader warp then holding the tile (run BB).
    pv_regs: bool = False
    # With gluon (16/32 heads a program): warps of the loader partition (1, 2 or 4; more than
    # one with slot ids one tile ahead only), each gathering its share of a tile's rows.
    loader_warps: int = 1


def resolve_slots_ahead(cfg: MLADecodeConfig, page_size: int, is_fp8: bool) -> bool:
    """`cfg.slots_ahead`, or the default: ahead except for bf16 pages (FP8 tiles go through
    registers for their conversion; bf16 pages were faster without). At page size 1 the ids
    read with their tile were 1.3-1.5x slower on an H200 (run AE)."""
    if cfg.slots_ahead is not None:
        return bool(cfg.slots_ahead)
    return page_size == 1 or is_fp8


def fp8_dots_fit(device: torch.device, kv_lora_rank: int, rope_dim: int, halves: bool) -> bool:
    """Whether QK can run as an e4m3 dot: a GPU with fp8 MMA (sm_89+; the CPU interpreter
    emulates it) and reduction dims of at least 32 (the latent, its halves, the RoPE part)."""
    latent = kv_lora_rank // 2 if halves else kv_lora_rank
    gpu_ok = is_interpreter() or has_fp8_cvt(device)
    return gpu_ok and min(latent, rope_dim) >= 32


def default_config(num_heads: int, is_fp8: bool, page_size: int = 1) -> MLADecodeConfig:
    """Tile shape per problem, from sweeps on an H200 (perf/bench_kernels.py --tune)."""
    if is_interpreter():
        fp8 = {"fp8_dots": is_fp8, "q_residual": is_fp8, "q_pairs": is_fp8}
        return MLADecodeConfig(16, 16, 4, 1, halves=True, **fp8)
    if num_heads <= 16:
        if is_fp8:
            # NOTE: QK as e4m3 wgmmas (64-token tiles), q as two e4m3 terms through one dot:
            # the error stays that of the fp8 cache alone. With the halves and 2 stages a
            # program takes 92 KB, two an SM (run AH); the same shape won paged (run AI).
            fp8 = {"halves": True, "fp8_dots": True, "q_residual": True, "q_pairs": True}
            return MLADecodeConfig(16, 64, 4, 2, 2.0, 128, **fp8)
        # NOTE: at 16 heads the latent goes as two halves (two MMA chains a warp): 1.03-1.10x
        # bf16 at page size 1, 1.01-1.11x paged bf16 (run AF).
        if page_size == 1:
            # NOTE: 32-token tiles with the ids read ahead fit two programs an SM (91 KB of
            # shared memory against 164 KB at 64 tokens): 1.01-1.16x at batch 16 and above,
            # 0.97-1.01x at batch 1 (run AE).
            return MLADecodeConfig(16, 32, 4, 3, 2.0, 128, halves=True)
        return MLADecodeConfig(16, 64, 4, 3, 2.0, 128, halves=True)
    # NOTE: at 128 heads QK as one e4m3 term was 1.02-1.19x faster than the fp16 dots (run
    # AH), but two terms, which keep FP8's accuracy at the fp16 dots', were 1.4-1.9x slower
    # as two dots and 1.16-1.33x slower through one (run AI): fp16 dots.
    return MLADecodeConfig(64, 64, 8, 2, 1.0, 128)


# With this many tokens of work a call (batch x the longest context) or more, the Gluon kernel
# takes 3 e4m3 tiles and V in 3 slots of 32 tokens (perf/RESULTS.md, run AK; from 128K to 64K
# tokens in run AP, where batch 16 ctx 4K ran 23.2 us deep against 24.8 with 2 tiles).
GLUON_DEEP_RING_TOKENS = 64 * 1024
# With this many tokens of work a call (batch x the longest context) or more, the engine's FP8
# pick at 16 heads a program reads V into the attention group's registers
# (`MLADecodeConfig.pv_regs`, 4 e4m3 tiles) instead of the converter's fp16 copy: 1.00-1.05x
# at 128K-1M tokens on an H100 (batch 128 ctx 16K: 0.97x and 1.03x in two calls), 0.80-0.94x at
# 1K-64K, where the converter form's shorter start of a program counts (perf/RESULTS.md, run
# AU). 0: at any size.
GLUON_PV_REGS_TOKENS = 128 * 1024
# Query heads across the batch (batch x num_heads) from which the Gluon kernel takes 32 heads a
# program (`gluon_config`).
GLUON_WIDE_HEAD_ROWS = 1024


def gluon_config(
    num_heads: int,
    batch: int,
    max_seq_len: int,
    fp8: bool = True,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
) -> MLADecodeConfig:
    """The warp-specialized Gluon kernels (sm_90). FP8 caches (`mla_decode_gluon`): q as two
    e4m3 terms, one program an SM: 2 e4m3 tiles and 2 fp16 V tiles in flight for small calls,
    3 e4m3 tiles and V in 3 slots of 32 tokens for larger ones, and from GLUON_PV_REGS_TOKENS
    of work V read into registers (`pv_regs`, 4 e4m3 tiles, no converter); wide calls of 64+
    heads take the kernel of 64 heads a program (`mla_decode_gluon_wide`: q as one e4m3 term,
    3 tiles).
    16-bit caches: at 64+ heads (`mla_decode_gluon_wide`) 64 heads a program, 2 tiles in
    flight; else `mla_decode_gluon`'s 16 heads a program over 2 tiles of the 16-bit ring (no
    converter: PV reads the ring's latent). The tile shapes are the kernels' own (`_launch`
    sets them); the Triton fields serve a GPU they miss."""
    if not fp8:
        if not mla_decode_gluon_wide.serves_shape(num_heads, kv_lora_rank, rope_dim):
            # The 16-head kernel over the 16-bit ring itself (no converter), 2 tiles.
            return default_config(num_heads, False)._replace(
                block_h=16, block_n=64, num_stages=2, waves=1.0, gluon=1, v_rows=64,
                merge_inside=GLUON_MERGE_INSIDE,
            )  # fmt: skip
        # NOTE: the default split count at block_h 64 and one wave was the best of the tuned
        # counts at 128 heads, ctx 4K, batch 1-128 (run AM).
        return default_config(num_heads, False)._replace(waves=1.0, gluon=1, gluon_heads=64)
    wide_rows = batch * num_heads >= GLUON_WIDE_HEAD_ROWS
    if wide_rows and mla_decode_gluon_wide.serves_shape(num_heads, kv_lora_rank, rope_dim):
        # NOTE: at 128 heads, ctx 4K, batch 16-128: 1.7-2.1x the 32-head form, 0.78-0.84x
        # FlashMLA FP8 (run AM, call 5). One e4m3 term for q: the tuned 2-term forms were
        # slower at every batch there, and one term's error (3.3e-2 against FlashMLA bf16) is
        # FlashMLA FP8's (3.6e-2), which quantizes q the same way.
        return default_config(num_heads, True)._replace(
            num_stages=3, waves=1.0, q_residual=False, gluon=1, gluon_heads=64
        )
    cfg = default_config(num_heads, True)._replace(
        num_stages=2, waves=1.0, q_residual=True, gluon=2, merge_inside=GLUON_MERGE_INSIDE
    )
    if batch * max_seq_len >= GLUON_DEEP_RING_TOKENS:
        # NOTE: a 32-token V slot is released after half of PV, so that the converter
        # refills it during the rest; the smaller V ring leaves room for a third e4m3 tile
        # (224 KB, `perf/gluon_census.py`): 1.02-1.05x at batch >= 64 (run AK).
        cfg = cfg._replace(num_stages=3, gluon=3, v_rows=32)
    if num_heads >= 32 and wide_rows:
        # NOTE: 32 heads a program halve the programs that read each tile: 1.34-1.54x the
        # 16-head form at 128 heads, batch 16-128, ctx 4K; at batch 1 (4 programs) 0.78x
        # (run AM). V in 32-token slots so that it fits, with 2 e4m3 tiles. The kernel of 64
        # heads a program takes these calls where the model's shape allows.
        cfg = cfg._replace(block_h=32, num_stages=2, gluon=2, v_rows=32, gluon_heads=32)
    elif batch * max_seq_len >= GLUON_PV_REGS_TOKENS:
        cfg = cfg._replace(
            num_stages=4, gluon=1, v_rows=64, pv_regs=True, q_residual=not GLUON_Q_ONE_TERM
        )
    return cfg


def _launch(
    q: torch.Tensor,
    kv: torch.Tensor,
    table: torch.Tensor,
    row_idx: torch.Tensor | None,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    k_scale: torch.Tensor | None,
    page_size: int,
    num_kv_splits: int | None,
    max_seq_len: int | None,
    config: MLADecodeConfig | None,
    value_proj: torch.Tensor | None = None,
) -> torch.Tensor:
    # q [B, H, C + R]; kv [num_slots, C + R] (any row stride); out [B, H, C], or [B, H, V]
    # with value_proj [H, C, V]
    batch, num_heads, head_dim = q.shape
    c = kv_lora_rank
    r = head_dim - c
    assert kv.shape[-1] == head_dim, (kv.shape, q.shape)
    assert c & (c - 1) == 0 and r & (r - 1) == 0, "kv_lora_rank and rope dim must be powers of 2"
    assert kv.stride(-1) == 1 and q.stride(-1) == 1
    is_fp8 = kv.dtype == torch.float8_e4m3fn
    if is_fp8:
        assert k_scale is not None, "an fp8 cache needs its k_scale"
    cfg = config or default_config(num_heads, is_fp8, page_size)
    if is_fp8 and cfg.fp8_dots and not fp8_dots_fit(q.device, c, r, cfg.halves):
        # NOTE: e4m3 dots need sm_89+ and a reduction dim of at least 32; a default config
        # falls back to fp16 dots, one asked for explicitly is refused.
        assert config is None, f"fp8_dots needs sm_89+ and parts >= 32 wide (latent {c}, rope {r})"
        cfg = cfg._replace(fp8_dots=False)
    wide = cfg.gluon > 0 and cfg.gluon_heads == mla_decode_gluon_wide.BLOCK_H.value
    if cfg.gluon and not wide and not mla_decode_gluon.fits(q.device, c, r, page_size):
        assert config is None, (
            "the Gluon kernel needs sm_90, a latent of 256/512, RoPE 32/64, pages of 1 or 64k"
        )
        cfg = cfg._replace(gluon=0)
    if wide and not mla_decode_gluon_wide.fits(q.device, num_heads, c, r, page_size):
        assert config is None, (
            "the Gluon kernel of 64 heads a program needs sm_90, 64+ heads, a latent of 512, "
            "RoPE 32/64, pages of 1 or 64k"
        )
        cfg, wide = cfg._replace(gluon=0), False
    if wide:
        cfg = cfg._replace(block_h=mla_decode_gluon_wide.BLOCK_H.value, block_n=64)
    gluon = cfg.gluon > 0 and not wide
    if gluon:
        heads_ok = (16, 32) if is_fp8 else (16,)
        assert cfg.gluon_heads in heads_ok, f"gluon_heads is one of {heads_ok} here"
        cfg = cfg._replace(block_h=cfg.gluon_heads, block_n=mla_decode_gluon.BLOCK_N.value)
    fp8_dots = is_fp8 and cfg.fp8_dots
    block_n = cfg.block_n if page_size == 1 else min(cfg.block_n, page_size)
    assert page_size == 1 or page_size % block_n == 0
    if num_kv_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())  # NOTE: a host sync; pass it when capturing
        num_kv_splits = choose_num_kv_splits(
            batch, num_heads, max_seq_len, cfg.block_h, block_n,
            waves=cfg.waves, min_tokens_per_split=cfg.min_split_tokens,
        )  # fmt: skip
    block_h = min(cfg.block_h, max(16, next_power_of_2(num_heads)))

    if value_proj is not None:
        assert value_proj.shape[:2] == (num_heads, c), (value_proj.shape, q.shape)
    # Few requests, heads and splits: the merge and the value projection in one launch.
    merge_project = value_proj is not None and merge_project_wanted(batch, num_heads, num_kv_splits)
    out = None if merge_project else q.new_empty(batch, num_heads, c)
    mid_lse = torch.empty((batch, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    # One split: stage 1 writes the final output itself and there is nothing to merge.
    if out is not None and num_kv_splits == 1:
        mid_o = out.unsqueeze(2)
    else:
        mid_o = torch.empty(
            (batch, num_heads, num_kv_splits, c), dtype=torch.float32, device=q.device
        )
    grid = (cdiv(num_heads, block_h), num_kv_splits, batch)
    # The merge inside the Gluon kernel: its programs wait for each other, so the whole grid
    # must be resident at once (one program an SM).
    counters = None
    wanted = gluon and cfg.merge_inside and cfg.gluon_heads == mla_decode_gluon.BLOCK_H.value
    if wanted and out is not None and merge_inside_fits(num_kv_splits, prod(grid)):
        counters = mla_decode_gluon.merge_counters(q.device)
    if gluon:
        mla_decode_gluon.launch_stage1(
            q, kv, table, row_idx, seq_lens, mid_o, mid_lse, sm_scale * _LOG2E, k_scale,
            page_size, cfg.num_stages, cfg.gluon, cfg.v_rows, cfg.q_residual, cfg.gluon_heads,
            cfg.pv_e4m3, out if counters is not None else None, counters, cfg.pv_regs,
            2 if 2 in (cfg.slots_ahead, GLUON_SLOTS_AHEAD) else 1, cfg.loader_warps,
        )  # fmt: skip
    elif wide:
        mla_decode_gluon_wide.launch_stage1(
            q, kv, table, row_idx, seq_lens, mid_o, mid_lse, sm_scale * _LOG2E, page_size,
            cfg.num_stages, k_scale, cfg.q_residual,
        )  # fmt: skip
    else:
        launch(
            _mla_decode_stage1,
            grid,
            q,
            kv,
            table,
            row_idx if row_idx is not None else seq_lens,
            seq_lens,
            mid_o,
            mid_lse,
            sm_scale * _LOG2E,
            k_scale if k_scale is not None else mid_lse,
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            table.stride(0),
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            num_heads,
            num_kv_splits,
            C=c,
            R=r,
            PAGE_SIZE=page_size,
            SLOT_TABLE=row_idx is not None,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            HAS_ROW_IDX=row_idx is not None,
            IS_FP8=is_fp8,
            USE_PTX=is_fp8 and not is_interpreter() and has_fp8_cvt(q.device),
            UPCAST=INTERPRET_UPCAST,
            SLOTS_AHEAD=resolve_slots_ahead(cfg, page_size, is_fp8),
            HALVES=cfg.halves,
            FP8_DOTS=fp8_dots,
            Q_RESIDUAL=fp8_dots and cfg.q_residual,
            Q_PAIRS=fp8_dots and cfg.q_residual and cfg.q_pairs,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            pdl=True,
        )
    if out is None:
        assert value_proj is not None
        y = q.new_empty(batch, num_heads, value_proj.shape[2])
        _merge_project(mid_o, mid_lse, value_proj, y)
        return y
    if num_kv_splits > 1 and counters is None:
        merge_splits(mid_o, mid_lse, out)
    return out if value_proj is None else _project(out, value_proj)


def mla_decode(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    config: MLADecodeConfig | None = None,
    page_size: int = 1,
    value_proj: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over the engine's latent pool, through `req_to_token`.

    q [B, H, C + R]; kv_buffer [num_slots, 1, C + R] (bf16/fp16/fp32, or fp8 e4m3 with
    k_scale [1] fp32); req_to_token [max_reqs, max_ctx] int32; req_pool_indices [B];
    seq_lens [B] (including the token being decoded). Returns o [B, H, C] in q's dtype, or with
    `value_proj` [H, C, V] (any strides; MLA's W_UV) o @ value_proj per head [B, H, V]: small
    batches merge the splits and project in one kernel.
    With `page_size` > 1 the pool is paged (positions i // page_size * page_size onwards sit in
    consecutive slots, the allocator's layout), and a tile reads one slot id instead of one per
    token.
    """
    kv = kv_buffer.view(kv_buffer.shape[0], kv_buffer.shape[-1])
    # NOTE: pages smaller than a 16-token tile are read slot by slot (the table has them all).
    page = page_size if page_size >= 16 else 1
    return _launch(
        q, kv, req_to_token, req_pool_indices, seq_lens, kv_lora_rank, sm_scale, k_scale,
        page, num_kv_splits, max_seq_len, config, value_proj,
    )  # fmt: skip


def mla_decode_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    config: MLADecodeConfig | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over FlashMLA's paged layout.

    q [B, H, C + R]; kv_cache [num_pages, page_size, 1, C + R]; block_table [B, max_pages] int32;
    seq_lens [B]. Returns o [B, H, C].
    """
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    kv = kv_cache.view(num_pages * page_size, kv_cache.shape[-1])
    return _launch(
        q, kv, block_table, None, seq_lens, kv_lora_rank, sm_scale, k_scale, page_size,
        num_kv_splits, max_seq_len, config,
    )  # fmt: skip
