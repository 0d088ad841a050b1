"""MLA decode stage 1 for 64 heads a program (128-head models) over a 16-bit or an FP8 (e4m3)
latent pool, as a warp-specialized Gluon kernel (sm_90) with V's columns split over two warp
groups.

At 128 heads the decode is bound by the tensor cores (241 FLOP a bf16 KV byte), and the Triton
kernel reaches about a third of FlashMLA's rate (perf/RESULTS.md): its 64-head programs wait
for every wgmma as soon as it is issued, and no warp loads while others compute. Here each
program (64-head group, split, request) runs the work the way FlashMLA lays it out, in three
partitions that hand tiles over through shared memory guarded by mbarriers:

- loader (1 warp, `mla_decode_gluon._loader`): gathers each 64-token tile's rows by slot id
  with 16-byte cp.async into a ring of 2 or 3 tiles (latent [64, C] and RoPE [64, R] parts);
- softmax group (the default partition, one warp group): per tile QK^T as one m64n64 wgmma
  chain (heads as M, q from shared memory), the online softmax, P and the rescale factor
  handed to the other group, and PV for V's first C/2 columns (m64n256, P as A);
- PV group (one warp group): rescales its accumulator and runs PV for the last C/2 columns.

Each group holds a [64, C/2] fp32 accumulator (128 registers a thread at C = 512), which is
why V is split: one warp group cannot hold [64, C]. Over a bf16 pool q (72 KB), two tiles
(144 KB) and P (8 KB) fill the Hopper SM's shared memory, so one program runs an SM.

Over an e4m3 pool q is quantized to e4m3 in the kernel (one scale a head group; with
`q_residual` its rounding error as a second e4m3 term chained into the same scores), QK runs
as e4m3 wgmmas straight from the ring, and the PV group first turns the tile's latent into an
fp16 copy (an 8-bit wgmma operand must be K-major, and V's K, the tokens, is its rows) while
the softmax group runs QK; the e4m3 slot is then free for the loader.

It is launched with programmatic dependent launch as the FP8 kernel is (`_pdl_wait` in each
partition).

Gluon compiles for the GPU only: CPU runs use the Triton kernel, and
`tests/kernels/test_mla_decode_gluon.py` checks this one against the torch reference on a
Hopper GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from engine.kernels.launch import is_interpreter, launch
from engine.kernels.mla_decode_gluon import (
    BLOCK_N,
    CONVERT_ROWS,
    _barrier,
    _loader,
    _n_tiles,
    _pdl_wait,
    _program_tokens,
)

BLOCK_H = gl.constexpr(64)  # heads a program: M of every wgmma
LOADER_WARPS = gl.constexpr(1)
PV_WARPS = gl.constexpr(4)
LOADER_REGS = gl.constexpr(80)
PV_REGS = gl.constexpr(192)
Q_ROWS_A_STEP = gl.constexpr(16)  # q rows the softmax group copies into shared memory a step


@gluon.jit
def _copy_q(q_base, stride_qh, hg, num_heads, dst, col0):
    """q's columns [col0, col0 + width) of the head group into dst [BLOCK_H, width], heads
    past num_heads as zeros, Q_ROWS_A_STEP rows at a time (few registers held)."""
    WIDTH: gl.constexpr = dst.shape[1]
    LANES_C: gl.constexpr = min(32, WIDTH // 8)  # lanes along a row, 8 elements (16 B) each
    layout: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 // LANES_C, LANES_C], [gl.num_warps(), 1], [1, 0]
    )
    offs_c = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    for r0 in gl.static_range(0, BLOCK_H, Q_ROWS_A_STEP):
        heads = hg * BLOCK_H + r0 + gl.arange(0, Q_ROWS_A_STEP, layout=gl.SliceLayout(1, layout))
        ptrs = q_base + heads[:, None] * stride_qh + offs_c[None, :]
        x = gl.load(ptrs, mask=(heads < num_heads)[:, None], other=0.0)
        dst.slice(r0, Q_ROWS_A_STEP).store(x)


@gluon.jit
def _store_half(mid_o_ptr, acc, inv, b, split, hg, num_heads, col0,
                stride_mob, stride_moh, stride_mos):  # fmt: skip
    """acc [BLOCK_H, C/2] times inv (per head) as the split's output columns from col0."""
    layout: gl.constexpr = acc.type.layout
    offs_h = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    offs_c = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    ptrs = (
        mid_o_ptr + b.to(gl.int64) * stride_mob + offs_h[:, None] * stride_moh
        + split * stride_mos + offs_c[None, :]
    )  # fmt: skip
    out = acc * gl.convert_layout(inv, gl.SliceLayout(1, layout))[:, None]
    gl.store(ptrs, out.to(mid_o_ptr.dtype.element_ty), mask=(offs_h < num_heads)[:, None])


@gluon.jit
def _quantize_q(q_base, stride_qh, hg, num_heads, q_s, q_pe_s):
    """q of the head group in e4m3 into q_s [T x BLOCH_H, C] / q_pe_s [T x BLOCK_H, R] (QK's A),
    one scale for the group; returns it (448 / max |q|). With T = 2 the rows from BLOCK_H on
    hold the rounding error of the first rows, in e4m3 too (chained into the same scores).
    Q_ROWS_A_STEP rows at a time, q read twice (its maximum first): few registers held."""
    C: gl.constexpr = q_s.shape[1]
    R: gl.constexpr = q_pe_s.shape[1]
    lat_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    pe_l: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 * 8 // R, R // 8], [gl.num_warps(), 1], [1, 0]
    )
    amax = 0.0
    for r0 in gl.static_range(0, BLOCK_H, Q_ROWS_A_STEP):
        lat = _q_rows(q_base, stride_qh, hg, num_heads, r0, 0, C, lat_l)
        pe = _q_rows(q_base, stride_qh, hg, num_heads, r0, C, R, pe_l)
        amax = gl.maximum(amax, gl.max(gl.max(gl.abs(lat), 1), 0))
        amax = gl.maximum(amax, gl.max(gl.max(gl.abs(pe), 1), 0))
    q_mul = 448.0 / gl.maximum(amax, 1e-30)
    # NOTE: the second pass's loads are volatile, so that the compiler does not keep the
    # first pass's values of all 64 rows live instead of loading again (it spilled).
    for r0 in gl.static_range(0, BLOCK_H, Q_ROWS_A_STEP):
        lat = _q_rows(q_base, stride_qh, hg, num_heads, r0, 0, C, lat_l, True)
        pe = _q_rows(q_base, stride_qh, hg, num_heads, r0, C, R, pe_l, True)
        _store_q_rows(lat * q_mul, q_s, r0)
        _store_q_rows(pe * q_mul, q_pe_s, r0)
    return q_mul


@gluon.jit
def _q_rows(q_base, stride_qh, hg, num_heads, r0, col0, WIDTH: gl.constexpr,
            layout: gl.constexpr, VOLATILE: gl.constexpr = False):  # fmt: skip
    """q's rows r0 .. r0 + Q_ROWS_A_STEP of the head group, columns col0 + [0, WIDTH), fp32."""
    heads = hg * BLOCK_H + r0 + gl.arange(0, Q_ROWS_A_STEP, layout=gl.SliceLayout(1, layout))
    offs_c = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    ptrs = q_base + heads[:, None] * stride_qh + offs_c[None, :]
    x = gl.load(ptrs, mask=(heads < num_heads)[:, None], other=0.0, volatile=VOLATILE)
    return x.to(gl.float32)


@gluon.jit
def _store_q_rows(y, dst, r0):
    """y in e4m3 into dst's rows from r0, and with a second term its rounding error into the
    rows from BLOCK_H + r0."""
    y8 = y.to(gl.float8e4nv)
    dst.slice(r0, Q_ROWS_A_STEP).store(y8)
    if dst.shape[0] == 2 * BLOCK_H:
        dst.slice(BLOCK_H + r0, Q_ROWS_A_STEP).store((y - y8.to(gl.float32)).to(gl.float8e4nv))


@gluon.jit
def _issue_qk(q_s, q_pe_s, lat, pe, zero):
    """Scores [heads, tokens] of one tile as one wgmma chain (q's second e4m3 term, if any,
    chained into the same accumulator), issued, not waited for."""
    sq = warpgroup_mma(q_s.slice(0, BLOCK_H), lat.permute((1, 0)), zero, use_acc=False,
                       is_async=True)  # fmt: skip
    sq = warpgroup_mma(q_pe_s.slice(0, BLOCK_H), pe.permute((1, 0)), sq, is_async=True)
    if q_s.shape[0] == 2 * BLOCK_H:
        sq = warpgroup_mma(q_s.slice(BLOCK_H, BLOCK_H), lat.permute((1, 0)), sq, is_async=True)
        sq = warpgroup_mma(q_pe_s.slice(BLOCK_H, BLOCK_H), pe.permute((1, 0)), sq, is_async=True)
    return sq


@gluon.jit
def _softmax_group(q_base, stride_qh, qk_scale, k_scale_ptr, q_s, q_pe_s, p_s, scale_s, v_s,
                   lat_ring, pe_ring, kv_ready, kv_empty, v_ready, v_empty, p_ready, p_empty,
                   mid_o_ptr, mid_lse_ptr, b, split, hg, start, end, num_heads,
                   stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                   USE_PDL: gl.constexpr):  # fmt: skip
    """One warp group: q into shared memory (in e4m3 over an FP8 ring), then per tile the
    scores, the online softmax, P and its rescale factor for the PV group, and PV over V's
    first half (V: the ring's tile, or over an FP8 ring its fp16 copy v_s); then the split's
    log-sum-exp (log2 units) and first output half, and the normalizer for the PV group's."""
    C: gl.constexpr = lat_ring.shape[2]
    HALF: gl.constexpr = C // 2
    STAGES: gl.constexpr = lat_ring.shape[0]
    FP8: gl.constexpr = lat_ring.dtype == gl.float8e4nv
    # NOTE: q is prepared here, not before the partitions start, so that the loader's first
    # gathers are in flight meanwhile.
    _pdl_wait(USE_PDL)
    if FP8:
        out_scale = gl.load(k_scale_ptr)
        scale = qk_scale * out_scale / _quantize_q(q_base, stride_qh, hg, num_heads, q_s, q_pe_s)
    else:
        out_scale = 1.0
        scale = qk_scale
        _copy_q(q_base, stride_qh, hg, num_heads, q_s, 0)
        _copy_q(q_base, stride_qh, hg, num_heads, q_pe_s, C)
    fence_async_shared()
    _barrier()

    K_STEP: gl.constexpr = 256 // lat_ring.dtype.primitive_bitwidth  # a wgmma's k: 16 or 32
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, K_STEP]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
    zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    offs_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    n_tiles = _n_tiles(start, end)
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(kv_ready.index(s), (i // STAGES) & 1)
        # The ring is written by cp.async (the generic proxy), read by the wgmma (async).
        fence_async_shared()
        lat = lat_ring.index(s)
        sq = _issue_qk(q_s, q_pe_s, lat, pe_ring.index(s), zero)
        sq = warpgroup_mma_wait(0, deps=(sq,))
        if FP8:
            mbarrier.arrive(kv_empty.index(s))  # (the PV group has converted V, or will)
        valid = start + i * BLOCK_N + offs_t < end
        qk = gl.where(valid[None, :], sq * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # P and alpha are overwritten once the PV group is done with the last tile's.
        mbarrier.wait(p_empty, (i & 1) ^ 1)
        p_s.store(p.to(p_s.dtype))
        scale_s.store(alpha)
        fence_async_shared()
        _barrier()
        if FP8:
            mbarrier.wait(v_ready, i & 1)  # this tile's V in fp16, from the PV group
            v = v_s
        else:
            v = lat
        mbarrier.arrive(p_ready)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(p_s, v.slice(0, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if FP8:
            mbarrier.arrive(v_empty)
        else:
            mbarrier.arrive(kv_empty.index(s))

    inv = out_scale / l_i
    mbarrier.wait(p_empty, (n_tiles & 1) ^ 1)
    scale_s.store(inv)
    _barrier()
    mbarrier.arrive(p_ready)
    offs_h = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
    lse_ptrs = mid_lse_ptr + b.to(gl.int64) * stride_mlb + offs_h * stride_mlh + split
    if end > start:
        gl.store(lse_ptrs, m_i + gl.log2(l_i), mask=offs_h < num_heads)
        _store_half(
            mid_o_ptr, acc, inv, b, split, hg, num_heads, 0, stride_mob, stride_moh, stride_mos
        )
    else:
        gl.store(lse_ptrs, m_i, mask=offs_h < num_heads)  # -inf: the split is empty


@gluon.jit
def _pv_group(p_s, scale_s, v_s, lat_ring, kv_ready, kv_empty, v_ready, v_empty, p_ready,
              p_empty, mid_o_ptr, b, split, hg, start, end, num_heads,
              stride_mob, stride_moh, stride_mos, USE_PDL: gl.constexpr):  # fmt: skip
    """One warp group: per tile (over an FP8 ring, first its latent turned into fp16 V in v_s,
    while the softmax group runs QK), its accumulator rescaled by the softmax group's factor
    and PV over V's last half; then that output half, normalized by the factor handed over."""
    C: gl.constexpr = lat_ring.shape[2]
    HALF: gl.constexpr = C // 2
    STAGES: gl.constexpr = lat_ring.shape[0]
    FP8: gl.constexpr = lat_ring.dtype == gl.float8e4nv
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    # 8 e4m3 a thread, so that its fp16 copy is one 16-byte store (as the FP8 kernel's converter).
    cvt_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
    n_tiles = _n_tiles(start, end)
    _pdl_wait(USE_PDL)  # (it writes global memory; the wait costs nothing past the first)
    for i in range(n_tiles):
        s = i % STAGES
        if FP8:
            mbarrier.wait(kv_ready.index(s), (i // STAGES) & 1)
            mbarrier.wait(v_empty, (i & 1) ^ 1)  # the softmax group's PV of the last tile done
            for r0 in gl.static_range(0, BLOCK_N, CONVERT_ROWS):
                x = lat_ring.index(s).slice(r0, CONVERT_ROWS).load(cvt_layout)
                v_s.slice(r0, CONVERT_ROWS).store(x.to(gl.float16))
            # Every warp's stores reach the async proxy (the wgmmas) before one thread signals.
            fence_async_shared()
            _barrier()
            mbarrier.arrive(v_ready)
            mbarrier.arrive(kv_empty.index(s))
            v = v_s
        else:
            v = lat_ring.index(s)
        mbarrier.wait(p_ready, i & 1)
        fence_async_shared()
        alpha = scale_s.load(gl.SliceLayout(1, o_layout))
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_s, v.slice(HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(p_empty)
        if not FP8:
            mbarrier.arrive(kv_empty.index(s))
    mbarrier.wait(p_ready, n_tiles & 1)
    if end > start:
        inv = scale_s.load(gl.SliceLayout(1, o_layout))
        _store_half(
            mid_o_ptr, acc, inv, b, split, hg, num_heads, HALF, stride_mob, stride_moh, stride_mos
        )


@gluon.jit
def mla_decode_wide_kernel(
    q_ptr,  # [B, H, C + R] (bf16 / fp16)
    kv_ptr,  # [num_slots, C + R]: q's dtype, or e4m3 (row stride given)
    table_ptr,  # [rows, cols] int32: slot ids per position (SLOT_TABLE) or page ids
    row_idx_ptr,  # [B] table row per request (only when HAS_ROW_IDX)
    seq_lens_ptr,  # [B]
    mid_o_ptr,  # [B, H, S, C] fp32, or the output [B, H, 1, C] when S == 1
    mid_lse_ptr,  # [B, H, S] fp32 (log2 units)
    qk_scale,  # sm_scale * log2(e)
    k_scale_ptr,  # [1] fp32: an e4m3 cache's scale (read only then)
    stride_qb, stride_qh, stride_kv, stride_table,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_heads, num_splits,
    C: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr, SLOT_TABLE: gl.constexpr,
    HAS_ROW_IDX: gl.constexpr, STAGES: gl.constexpr, Q_RESIDUAL: gl.constexpr,
    USE_PDL: gl.constexpr = False,
):  # fmt: skip
    hg, split, b, table_row, start, end = _program_tokens(
        seq_lens_ptr, row_idx_ptr, table_ptr, stride_table, num_splits, HAS_ROW_IDX
    )
    q_base = q_ptr + b.to(gl.int64) * stride_qb
    kv_dtype: gl.constexpr = kv_ptr.dtype.element_ty
    FP8: gl.constexpr = kv_dtype == gl.float8e4nv
    BITS: gl.constexpr = kv_dtype.primitive_bitwidth

    # NOTE: over an e4m3 cache QK is an e4m3 wgmma straight from the ring, with q in e4m3 as
    # one term or (Q_RESIDUAL) two; V goes through an fp16 copy, since an 8-bit wgmma operand
    # must be K-major and V's K (the tokens) is its rows.
    Q_ROWS: gl.constexpr = 2 * BLOCK_H if FP8 and Q_RESIDUAL else BLOCK_H
    lat_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=BITS)
    pe_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=min(R * BITS // 8, 128), element_bitwidth=BITS
    )
    f16_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16)
    p_dtype: gl.constexpr = gl.float16 if FP8 else kv_dtype
    q_s = gl.allocate_shared_memory(kv_dtype, [Q_ROWS, C], lat_layout)
    q_pe_s = gl.allocate_shared_memory(kv_dtype, [Q_ROWS, R], pe_layout)
    p_s = gl.allocate_shared_memory(p_dtype, [BLOCK_H, BLOCK_N], f16_layout)
    lat_ring = gl.allocate_shared_memory(kv_dtype, [STAGES, BLOCK_N, C], lat_layout)
    pe_ring = gl.allocate_shared_memory(kv_dtype, [STAGES, BLOCK_N, R], pe_layout)
    scale_s = gl.allocate_shared_memory(
        gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(s), count=32 * LOADER_WARPS)  # every loader lane's copies
        # Both groups: their PV of the tile, or over e4m3 the QK and V's conversion.
        mbarrier.init(kv_empty.index(s), count=2)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_empty, count=1)
    if FP8:
        v_s = gl.allocate_shared_memory(gl.float16, [BLOCK_N, C], f16_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(v_ready, count=1)
        mbarrier.init(v_empty, count=1)
    else:
        v_s = lat_ring  # (unused: V is the ring's tile)
        v_ready = p_ready
        v_empty = p_empty

    gl.warp_specialize(
        [
            (
                _softmax_group,
                (
                    q_base, stride_qh, qk_scale, k_scale_ptr, q_s, q_pe_s, p_s, scale_s, v_s,
                    lat_ring, pe_ring, kv_ready, kv_empty, v_ready, v_empty, p_ready, p_empty,
                    mid_o_ptr, mid_lse_ptr, b, split, hg, start, end, num_heads,
                    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, USE_PDL,
                ),
            ),
            (
                _pv_group,
                (
                    p_s, scale_s, v_s, lat_ring, kv_ready, kv_empty, v_ready, v_empty, p_ready,
                    p_empty, mid_o_ptr, b, split, hg, start, end, num_heads,
                    stride_mob, stride_moh, stride_mos, USE_PDL,
                ),
            ),
            (
                _loader,
                (
                    kv_ptr, table_row, start, end, stride_kv, lat_ring, pe_ring, kv_ready,
                    kv_empty, PAGE_SIZE, SLOT_TABLE, USE_PDL,
                ),
            ),
        ],
        [PV_WARPS, LOADER_WARPS],
        [PV_REGS, LOADER_REGS],
    )  # fmt: skip


def fits(device: torch.device, num_heads: int, kv_lora_rank: int, rope_dim: int,
         page_size: int) -> bool:  # fmt: skip
    """Whether this kernel serves: a Hopper GPU (wgmma; Gluon compiles, never interprets), at
    least 64 heads, a latent of 512 (bf16: two 64-token tiles beside q in shared memory), a
    RoPE part of 32 or 64, and tiles that stay inside a page."""
    if is_interpreter() or device.type != "cuda":
        return False
    hopper = torch.cuda.get_device_capability(device) == (9, 0)
    pages_ok = page_size == 1 or page_size % BLOCK_N.value == 0
    return hopper and serves_shape(num_heads, kv_lora_rank, rope_dim) and pages_ok


def serves_shape(num_heads: int, kv_lora_rank: int, rope_dim: int) -> bool:
    """The model shapes of `fits`: 64+ heads, a latent of 512, a RoPE part of 32 or 64."""
    return num_heads >= BLOCK_H.value and kv_lora_rank == 512 and rope_dim in (32, 64)


def launch_stage1(
    q: torch.Tensor,
    kv: torch.Tensor,
    table: torch.Tensor,
    row_idx: torch.Tensor | None,
    seq_lens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    qk_scale: float,
    page_size: int,
    stages: int = 2,
    k_scale: torch.Tensor | None = None,
    q_residual: bool = True,
) -> None:
    """Stage 1 over a pool kv [num_slots, C + R] of q's dtype, or e4m3 with its `k_scale` (q
    then in e4m3, as two terms with `q_residual`): writes mid_o [B, H, S, C] (or the output,
    S == 1) and mid_lse [B, H, S] as `mla_decode._mla_decode_stage1` does."""
    batch, num_heads, head_dim = q.shape
    c = mid_o.shape[-1]
    fp8 = kv.dtype == torch.float8_e4m3fn
    assert fp8 == (k_scale is not None) and (fp8 or q.dtype == kv.dtype), (q.dtype, kv.dtype)
    grid = (triton.cdiv(num_heads, BLOCK_H.value), mid_lse.shape[2], batch)
    launch(
        mla_decode_wide_kernel, grid,
        q, kv, table, row_idx if row_idx is not None else seq_lens, seq_lens, mid_o, mid_lse,
        qk_scale, k_scale if k_scale is not None else mid_lse, q.stride(0), q.stride(1),
        kv.stride(0), table.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), num_heads, mid_lse.shape[2], C=c, R=head_dim - c,
        PAGE_SIZE=page_size, SLOT_TABLE=row_idx is not None, HAS_ROW_IDX=row_idx is not None,
        STAGES=stages, Q_RESIDUAL=fp8 and q_residual, num_warps=4, pdl=True,
    )  # fmt: skip
