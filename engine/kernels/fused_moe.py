"""Fused MoE: tokens aligned to experts in blocks, one grouped GEMM for gate/up (SiLU-and-mul
fused into its epilogue) and one for down (top-k weight fused), then the top-k sum.

`moe_align_block_size` groups the (token, k) pairs by expert and pads each expert's run to a
multiple of BLOCK_M, in one Triton program with no sort and no host sync (CUDA-graph safe).
Each GEMM program takes one BLOCK_M block, which belongs to exactly one expert, and one BLOCK_N
slice of the output.

Decode runs the same grouped GEMMs, with narrow tiles (`default_moe_config`). Up to
INLINE_ALIGN_MAX_PAIRS pairs (a decode step of up to 4 tokens at V2-Lite's 6 + 2 experts) there
is no alignment kernel: each GEMM program works out its own block's expert and rows from the
[T, k] ids, which a decode step's few pairs make cheap (one launch less per layer). A GEMV path for
decode (one program per (token, expert) pair, no alignment) was tried and removed: on an H200 it
was 0.71-0.98x of the grouped GEMMs at 1-8 tokens (perf/RESULTS.md, "Fused MoE").
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
    dot,
    is_interpreter,
    next_power_of_2,
    pdl_wait,
)


class MoEAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # [max_padded] int32: flat (token * top_k + k) ids; pad = T * top_k
    expert_ids: torch.Tensor  # [max_blocks] int32: the expert of each BLOCK_M block
    num_padded: torch.Tensor  # [1] int32: used length of sorted_ids


class InlineAlignment(NamedTuple):
    """No alignment tables: each GEMM program aligns its own block from the pairs' experts."""

    topk_ids: torch.Tensor  # [T * top_k]: the expert of each (token, k) pair
    num_experts: int  # routed experts plus shared slots


# Up to this many (token, expert) pairs each GEMM program aligns its own block (see above):
# 32 pairs is a batch of 4 at V2-Lite's 6 + 2 experts. Measured on the H200 at one token (8
# pairs); larger batches keep the alignment kernel until the in-program form is timed there.
INLINE_ALIGN_MAX_PAIRS = 32
ALIGN_CHUNK = 2048  # pairs the alignment program counts (and, up to this many, places) at once
PLACE_CHUNK = 512  # pairs a placing program takes


class MoEConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class MoETiles(NamedTuple):
    """One config per grouped GEMM; both share BLOCK_M (the alignment's block)."""

    up: MoEConfig  # gate/up: N = 2 x intermediate (two accumulators), K = hidden
    down: MoEConfig  # down: N = hidden, K = intermediate


def default_moe_config(num_pairs: int, num_experts: int, elem_bytes: int = 2) -> MoETiles:
    """Tiles by load, from `perf/bench_kernels.py --tune-moe` on an H200 (V2-Lite's shape):
    few (token, expert) pairs per expert (decode) stream the weights with narrow tiles and deep
    pipelines (80-100% of the copy bandwidth); many (prefill) use 128-row tiles on the tensor
    cores (about 450 TFLOP/s at 2,048 and 8,192 tokens, 1.3-1.5x the 64-row tiles).

    The tiles are sized for 16-bit weights; fp32 halves BLOCK_K to stay in shared memory.
    """
    if is_interpreter():
        cfg = MoEConfig(16, 32, 32, 4, 1)
        return MoETiles(cfg, cfg)
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:  # gate/up: 3 stages (25.0 us at one token, 26.0 with 4; run of 12-02)
        tiles = MoETiles(MoEConfig(16, 32, 128, 4, 3), MoEConfig(16, 64, 128, 4, 4))
    elif per_expert <= 128:
        tiles = MoETiles(MoEConfig(64, 64, 64, 4, 3), MoEConfig(64, 128, 64, 8, 4))
    else:
        tiles = MoETiles(MoEConfig(128, 128, 64, 8, 4), MoEConfig(128, 256, 64, 8, 4))
    if elem_bytes > 2:  # fp32: half the K tile
        return MoETiles(*(c._replace(block_k=c.block_k // 2) for c in tiles))
    return tiles


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])  # see launch.py
def _moe_align_kernel(
    topk_ids_ptr,  # [num_pairs] expert of each (token, k) pair
    sorted_ids_ptr,  # [max_padded] int32 out
    expert_ids_ptr,  # [max_blocks] int32 out
    num_padded_ptr,  # [1] int32 out
    cursor_ptr,  # [num_experts] int32 out: each expert's first place (for _moe_place_kernel)
    num_pairs, num_experts, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, CHUNK_B: tl.constexpr,
    PLACE: tl.constexpr,
):  # fmt: skip
    """One program. Count the pairs of each expert, lay the experts' runs out padded to
    BLOCK_M, write the pads of each run (the places its pairs leave; nothing past num_padded,
    which the GEMMs do not read) and every block's expert. PLACE (at most CHUNK pairs): place
    the pairs too, as _moe_place_kernel does (a decode step's pairs: one launch, not two)."""
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        mask = offs < num_pairs - start
        ids = tl.load(topk_ids_ptr + start + offs, mask=mask, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=mask)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    tl.store(cursor_ptr + offs_e, padded_start, mask=mask_e)
    pad = tl.zeros([BLOCK_E], tl.int32) + num_pairs
    for j in range(0, BLOCK_M - 1):  # the j-th pad of every run that has one
        pads = (j < padded - counts) & mask_e
        tl.store(sorted_ids_ptr + padded_start + counts + j, pad, mask=pads)
    for start in range(0, max_blocks, CHUNK_B):  # block b's expert: those ending at or before b
        blocks = start + tl.arange(0, CHUNK_B)
        ended = (padded_end[None, :] <= blocks[:, None] * BLOCK_M) & mask_e[None, :]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), 1), num_experts - 1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < max_blocks)
    if PLACE:
        tl.debug_barrier()  # the cursors are written before any pair takes a place
        _place_pairs(topk_ids_ptr, sorted_ids_ptr, cursor_ptr, num_pairs, offs)


@triton.jit
def _place_pairs(topk_ids_ptr, sorted_ids_ptr, cursor_ptr, num_pairs, offs):
    """Pairs `offs` take the next free place in their expert's run (an atomic cursor per
    expert): no sort. The order within a run is whatever the atomics make it; each row of the
    grouped GEMMs is computed on its own, so the results do not depend on it."""
    mask = offs < num_pairs
    ids = tl.load(topk_ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    dest = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
    tl.store(sorted_ids_ptr + dest, offs, mask=mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_place_kernel(topk_ids_ptr, sorted_ids_ptr, cursor_ptr, num_pairs, CHUNK: tl.constexpr):
    """Program c places the pairs of chunk c (after _moe_align_kernel wrote the cursors)."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    _place_pairs(topk_ids_ptr, sorted_ids_ptr, cursor_ptr, num_pairs, offs)


def max_align_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M blocks an alignment can use: every used block holds at least one pair,
    and the padded runs add at most block_m - 1 places per expert."""
    return min(cdiv(num_pairs + num_experts * (block_m - 1), block_m), num_pairs)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """topk_ids [T, k] -> pairs grouped by expert, each expert's run padded to block_m.

    No sort and no host sync (a CUDA graph can capture it): one program lays the runs out and,
    up to ALIGN_CHUNK pairs (decode batches), places the pairs; more pairs (prefill) are placed
    by a second launch of a program per PLACE_CHUNK pairs: one program placing the 16,384 pairs
    of a 2,048-token prefill chunk by chunk took 60 us a layer on the H200. The places past
    num_padded are left unwritten (the GEMMs read none).
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_blocks = max_align_blocks(num_pairs, num_experts, block_m)
    device = flat.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    block_e = max(16, next_power_of_2(num_experts))
    # The block -> expert step holds a [CHUNK_B, BLOCK_E] compare: keep it near 8K elements.
    chunk_b = max(32, 8192 // block_e)
    in_program = num_pairs <= ALIGN_CHUNK
    launch(
        _moe_align_kernel, (1,),
        flat, sorted_ids, expert_ids, num_padded, cursor, num_pairs, num_experts, max_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=ALIGN_CHUNK, CHUNK_B=chunk_b, PLACE=in_program,
        num_warps=8,
    )  # fmt: skip
    if not in_program:
        launch(
            _moe_place_kernel, (cdiv(num_pairs, PLACE_CHUNK),),
            flat, sorted_ids, cursor, num_pairs, CHUNK=PLACE_CHUNK, num_warps=4,
        )  # fmt: skip
    return MoEAlignment(sorted_ids, expert_ids, num_padded)


@triton.jit
def _inline_block(topk_ids_ptr, num_pairs, pid_m, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_E: tl.constexpr):  # fmt: skip
    """Block pid_m of the alignment `moe_align_block_size` would make, from the pairs' expert
    ids alone: (whether the block is used, its expert, its BLOCK_M pair ids, num_pairs where
    padded). Pairs keep their order within an expert's run (a rank by pair index)."""
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < num_pairs
    pair_e = tl.load(topk_ids_ptr + offs_p, mask=mask_p, other=0).to(tl.int32)
    blocks = (tl.histogram(pair_e, BLOCK_E, mask=mask_p) + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)  # [BLOCK_E]: blocks of the experts up to and including e
    expert = tl.sum((block_end <= pid_m).to(tl.int32), 0)  # experts wholly before pid_m
    offs_e = tl.arange(0, BLOCK_E)
    first = tl.sum(tl.where(offs_e == expert, block_end - blocks, 0), 0)
    mine = (pair_e == expert) & mask_p
    # The row of this block each of the expert's pairs takes: its rank among them, less the
    # rows of the expert's earlier blocks.
    place = tl.cumsum(mine.to(tl.int32), 0) - 1 - (pid_m - first) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    hit = mine[None, :] & (place[None, :] == offs_m[:, None])
    ids = tl.sum(tl.where(hit, offs_p[None, :], 0), 1)
    ids = tl.where(tl.sum(hit.to(tl.int32), 1) > 0, ids, num_pairs)
    return pid_m < tl.sum(blocks, 0), expert.to(tl.int64), ids


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: hidden [T, H] (A_DIV_TOPK) or activations [T * top_k, I]
    b_ptr,  # [E, N (x2 when GATED), K]: w13 or w2
    s_ptr,  # HAS_SHARED: the shared experts' gate_up [2 * S, K] or down [N, S]
    c_ptr,  # [T * top_k, N]
    topk_w_ptr,  # [T * top_k] fp32
    sorted_ids_ptr,  # the alignment's (INLINE_ALIGN: the [T * top_k] expert ids instead)
    expert_ids_ptr,
    num_padded_ptr,
    N, K, num_pairs, top_k,
    stride_am, stride_be, stride_bn, stride_cm,
    num_routed, s_stride_be, s_stride_bn, s_up,
    A_DIV_TOPK: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    HAS_SHARED: tl.constexpr, INLINE_ALIGN: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    EARLY_IDS: tl.constexpr = False, EARLY_SHARED: tl.constexpr = 0,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """EARLY_IDS: the pair ids and alignment were written two or more launches back (the down
    GEMM: router, gate/up, down), so under PDL they are read before the wait. (Prefetching the
    block's expert rows into L2 there too made the batch-1 step slower on the H200, 2.20
    against 2.07 ms: the 46 MB competed with the gate/up GEMM's stream and were mostly evicted
    by it before use.)

    EARLY_SHARED = S > 0 (INLINE_ALIGN, the gate/up GEMM, at most BLOCK_M tokens, the shared
    slots the last S columns of the ids): blocks 0..S-1 are the shared slots, whose expert and
    rows (every token) are known without the router, and whose input rows are the router's
    input (written two launches back): they run their whole GEMM before the PDL wait, while
    the router runs, and wait only to store. The routed blocks follow, S places on."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if EARLY_SHARED > 0:
        if pid_m < EARLY_SHARED:
            expert = (num_routed + pid_m).to(tl.int64)
            offs_m = tl.arange(0, BLOCK_M)
            slot_col = top_k - EARLY_SHARED + pid_m
            ids = tl.where(offs_m < num_pairs // top_k, offs_m * top_k + slot_col, num_pairs)
            found = pid_m >= 0
        else:
            pdl_wait(USE_PDL)
            found, expert, ids = _inline_block(
                sorted_ids_ptr, num_pairs, pid_m - EARLY_SHARED, BLOCK_M, BLOCK_P, BLOCK_E
            )
            found = found & (expert < num_routed)  # the shared slots' own blocks did those
    elif INLINE_ALIGN:
        if not EARLY_IDS:
            pdl_wait(USE_PDL)
        found, expert, ids = _inline_block(
            sorted_ids_ptr, num_pairs, pid_m, BLOCK_M, BLOCK_P, BLOCK_E
        )
    else:
        if not EARLY_IDS:
            pdl_wait(USE_PDL)
        num_padded = tl.load(num_padded_ptr)  # a multiple of BLOCK_M
        found = pid_m * BLOCK_M < num_padded
        # (an unused block's places may lie past the table: not read)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ids = tl.load(sorted_ids_ptr + offs_m, mask=offs_m < num_padded, other=num_pairs)
        expert = tl.load(expert_ids_ptr + pid_m, mask=found, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # The expert's weight [N (gate, then up at `up` when GATED), K], rows `bn` apart.
    b_base = b_ptr + expert * stride_be
    bn = tl.cast(stride_bn, tl.int64)
    up = tl.cast(N, tl.int64) * stride_bn
    if HAS_SHARED:
        if expert >= num_routed:  # slot j of the shared experts: a slice of their MLP weights
            b_base = s_ptr + (expert - num_routed) * s_stride_be
            bn = tl.cast(s_stride_bn, tl.int64)
            up = tl.cast(s_up, tl.int64)
    if EARLY_IDS:
        pdl_wait(USE_PDL)
    if not found:
        return
    valid = ids < num_pairs
    if A_DIV_TOPK:
        a_rows = ids // top_k
    else:
        a_rows = ids
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_base + offs_n[None, :].to(tl.int64) * bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        acc += dot(a, b, UPCAST)
        if GATED:
            b_up = tl.load(b_ptrs + up, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc_up += dot(a, b_up, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if MUL_WEIGHT:
        w = tl.load(topk_w_ptr + ids, mask=valid, other=0.0)
        acc = acc * w[:, None]
    if EARLY_SHARED > 0:
        if pid_m < EARLY_SHARED:
            pdl_wait(USE_PDL)  # nothing is written before the wait
    c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


class SharedExperts(NamedTuple):
    """The shared experts' MLP weights, run by the fused MoE as `num_slots` always-on experts
    of the routed experts' intermediate size I: slot j is rows j*I..(j+1)*I of the gate and up
    halves of `gate_up` and the same columns of `down`. (An MLP of intermediate n*I is the sum
    of n MLPs over its slices of I.) The router gives each slot weight 1."""

    gate_up: torch.Tensor  # [2 * S, H] (gate rows, then up rows), S = num_slots * I
    down: torch.Tensor  # [H, S]


def _moe_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    align: MoEAlignment | InlineAlignment,
    top_k: int,
    n: int,
    a_div_topk: bool,
    gated: bool,
    mul_weight: bool,
    cfg: MoEConfig,
    shared: torch.Tensor | None,
    early_ids: bool = False,
    early_shared: int = 0,
) -> None:
    """One grouped GEMM; `early_ids`: the alignment was written two or more launches before
    this one (see _moe_gemm_kernel's EARLY_IDS); `early_shared`: that many shared slots run
    before the PDL wait (EARLY_SHARED: the gate/up GEMM, inline alignment, one block a slot)."""
    k = a.shape[1]
    num_routed = b.shape[0]
    num_pairs = topk_weights.shape[0]
    assert not early_shared or (gated and shared is not None and not early_ids)
    assert not early_shared or (
        isinstance(align, InlineAlignment) and num_pairs // top_k <= cfg.block_m
    )
    if shared is None:
        s_args = (b, num_routed, 0, 0, 0)
    elif gated:  # gate_up [2 * S, K]: slot j starts at row j * n, up half S rows on
        s_args = (shared, num_routed, n * shared.stride(0), shared.stride(0),
                  shared.shape[0] // 2 * shared.stride(0))  # fmt: skip
    else:  # down [N, S]: slot j is columns j * K.., rows S apart
        s_args = (shared, num_routed, k, shared.stride(0), 0)
    if isinstance(align, InlineAlignment):
        blocks = max_align_blocks(num_pairs, align.num_experts, cfg.block_m)
        if early_shared:  # the shared slots' blocks, then the routed pairs'
            routed = num_pairs // top_k * (top_k - early_shared)
            blocks = early_shared + max_align_blocks(routed, num_routed, cfg.block_m)
        tables = (align.topk_ids,) * 3  # the kernel reads the pairs' experts from the first
        block_e = max(16, next_power_of_2(align.num_experts))
    else:
        blocks, block_e = align.expert_ids.shape[0], 16
        tables = (align.sorted_ids, align.expert_ids, align.num_padded)
    grid = (blocks, cdiv(n, cfg.block_n))
    launch(
        _moe_gemm_kernel, grid,
        a, b, s_args[0], c, topk_weights, *tables,
        n, k, num_pairs, top_k, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        *s_args[1:],
        A_DIV_TOPK=a_div_topk, GATED=gated, MUL_WEIGHT=mul_weight, HAS_SHARED=shared is not None,
        INLINE_ALIGN=isinstance(align, InlineAlignment),
        # One variant for every batch that aligns in-program (a size that followed the batch
        # would be built at the first decode of each size when no graph captured it).
        BLOCK_P=next_power_of_2(INLINE_ALIGN_MAX_PAIRS), BLOCK_E=block_e,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=INTERPRET_UPCAST,
        EARLY_IDS=early_ids, EARLY_SHARED=early_shared, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, pdl=True,
    )  # fmt: skip


@triton.jit
def _moe_sum_kernel(
    down_ptr,  # [T, top_k, H]
    shared_ptr,  # [T, H] (HAS_SHARED)
    out_ptr,  # [T, H]
    H, stride_shared,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(down_ptr + (t * TOP_K + k) * H + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t * stride_shared + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _moe_sum(down: torch.Tensor, shared_output: torch.Tensor | None) -> torch.Tensor:
    # down [T, top_k, H] -> [T, H] (+ shared_output [T, H])
    num_tokens, top_k, hidden_size = down.shape
    out = down.new_empty((num_tokens, hidden_size))
    if num_tokens == 0:
        return out
    if shared_output is not None:
        assert shared_output.stride(1) == 1 and shared_output.shape == out.shape
    block_h = min(1024, next_power_of_2(hidden_size))
    launch(
        _moe_sum_kernel, (num_tokens, cdiv(hidden_size, block_h)),
        down, shared_output if shared_output is not None else out, out, hidden_size,
        shared_output.stride(0) if shared_output is not None else 0,
        TOP_K=top_k, HAS_SHARED=shared_output is not None, BLOCK_H=block_h,
        num_warps=4 if block_h >= 512 else 1, pdl=True,
    )  # fmt: skip
    return out


def shared_expert_slots(shared: SharedExperts, inter: int) -> int:
    """How many experts of intermediate size `inter` the shared MLP makes (0: it does not
    split into whole slots, so it cannot run inside the fused MoE)."""
    size = shared.down.shape[1]
    return size // inter if size % inter == 0 else 0


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoETiles | None = None,
    shared_output: torch.Tensor | None = None,
    shared_experts: SharedExperts | None = None,
) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    topk_weights [T, k]; topk_ids [T, k]; shared_output [T, H] or None. Returns [T, H] =
    sum_k w_k * down(silu(g) * u) (+ shared_output, added in the same fp32 sum).

    With `shared_experts`, ids E..E+n-1 in topk_ids name its n slots (`SharedExperts`), in
    its last n columns, in order (as the router and `append_shared_experts` lay them out: a
    decode step's gate/up GEMM runs them from that layout before the router has finished).
    `config` overrides the default tiles (the tuner's way to time them). No host sync and no
    data-dependent shape, so a CUDA graph can capture it."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    assert hidden.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    if shared_experts is not None:
        gate_up, down = shared_experts
        assert gate_up.stride(1) == 1 and down.stride(1) == 1 and gate_up.dtype == w13.dtype
        slots = shared_expert_slots(shared_experts, inter)
        assert slots > 0 and gate_up.shape == (2 * slots * inter, hidden_size)
        num_experts += slots
    tiles = config or default_moe_config(num_tokens * top_k, num_experts, w13.element_size())
    assert tiles.up.block_m == tiles.down.block_m
    align: MoEAlignment | InlineAlignment
    if num_tokens * top_k <= INLINE_ALIGN_MAX_PAIRS:
        align = InlineAlignment(topk_ids.reshape(-1), num_experts)
    else:
        align = moe_align_block_size(topk_ids, num_experts, tiles.up.block_m)
    weights = topk_weights.reshape(-1).to(torch.float32)
    act = hidden.new_empty((num_tokens * top_k, inter))
    s13 = s2 = None
    early_shared = 0
    if shared_experts is not None:
        s13, s2 = shared_experts
        # A decode step's shared slots, one block each, run their gate/up before the router ends.
        if isinstance(align, InlineAlignment) and num_tokens <= tiles.up.block_m:
            early_shared = slots
    _moe_gemm(
        hidden, w13, act, weights, align, top_k, inter, True, True, False, tiles.up, s13,
        early_shared=early_shared,
    )  # fmt: skip
    down_out = hidden.new_empty((num_tokens * top_k, hidden_size))
    # The down GEMM's pair tables come from the router (or the alignment), two launches back.
    _moe_gemm(
        act, w2, down_out, weights, align, top_k, hidden_size, False, False, True, tiles.down,
        s2, early_ids=True,
    )  # fmt: skip
    return _moe_sum(down_out.view(num_tokens, top_k, hidden_size), shared_output)
