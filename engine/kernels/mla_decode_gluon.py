"""MLA decode stage 1 over an FP8 (e4m3) latent pool as a warp-specialized Gluon kernel (sm_90).

The Triton kernel (`mla_decode._mla_decode_stage1`) converts each e4m3 V tile to fp16 in the
same warps that run the MMAs and the softmax, so loading and converting set its time (perf/
RESULTS.md, run AI). Here each program (head group of HEADS = 16, split, request) runs three
partitions that hand tiles to each other through shared-memory rings guarded by mbarriers:

- loader (1 warp): gathers each 64-token tile's rows by slot id with 16-byte cp.async into the
  e4m3 ring (latent [64, C] and RoPE [64, R] parts), masked rows zero-filled;
- converter (4 warps): turns the tile's e4m3 latent into an fp16 copy in the V ring;
- attention (the default partition, one warp group): QK^T as e4m3 wgmmas with the tile's tokens
  as M (scores [64 tokens, 16 heads]), straight from the e4m3 ring; the online softmax along
  the tokens; PV as fp16 wgmmas with the latent as M (O^T [C, 16 heads] += V^T P^T), V^T read
  from the fp16 copy in place (a 16-bit operand may be MN-major).

The attention partition first quantizes q to e4m3 per (request, head group), while the
loader's first gathers are in flight, as one term or, with Q_RESIDUAL, as two (q and 16x its
rounding error), so that the error stays that of the cache's own rounding. The splits' outputs
and log-sum-exps are those of the Triton kernel (`store_split`), merged by `merge_splits`.
The fp16 V ring may be cut into slots of V_ROWS tokens, each released once its part of PV is
done, which leaves room for a third e4m3 tile (`mla_decode.gluon_config` takes that form for
large calls).

HEADS = 32 (`MLADecodeConfig.gluon_heads`, for 128-head models: each tile read by half as many
programs) fits with V in 32-token slots (1.34-1.54x the 16-head form at 128 heads, batch
16-128, run AM); `mla_decode.gluon_config` takes it for wide calls of a latent that
`mla_decode_gluon_wide` (64 heads a program, about 2x faster there) does not serve.

Measured on an H200 (perf/RESULTS.md, run AL), page size 1: 1.08-1.15x the Triton kernel at
batch 1 and 1.10-1.36x at batch 16-128; 0.93-1.15x FlashMLA's FP8 kernel at batch >= 16
(0.84-0.88x at batch 1), with the Triton kernel's error. The engine takes it by default where
it serves (`EngineConfig.mla_decode_kernel="auto"`); `MLADecodeConfig(..., gluon=N)` asks for
it in a direct call. On an H100 with the deep ring from 64K tokens and the split merge cut by
columns at few rows (run AQ): 0.99-1.24x FlashMLA FP8 at batch 16-128 and 1.06-1.36x at batch
1, where most of the old deficit was the merge's 16 programs, not this kernel.

`MLADecodeConfig.pv_e4m3` runs PV as an e4m3 wgmma instead (as FlashMLA's FP8 kernel does):
the converter warps write each tile's latent transposed, in e4m3, into a V^T ring
(`_transposer`: 32 KB written a tile instead of 64, bank-conflict free by the lane layout and
the token and row orders it picks), and P goes to shared memory in e4m3 (times 256) in the
same token order. Right on an H100 and 1.02-1.07x the fp16 PV at batch 1-16, but P's e4m3
rounding moved the engine's logits past its tests' bound (perf/RESULTS.md, run AN): opt-in.

Over a 16-bit pool (bf16 or fp16, `mla_decode.gluon_config(..., fp8=False)` below 64 heads)
the same kernel runs without the converter: q is staged as it is, QK and PV are 16-bit wgmmas
straight from a 2-slot ring (V^T is the slot's latent read MN-major), and a slot goes back to
the loader once PV is done. Each tile's QK waits for its own tile only (with the next tile's
QK issued ahead, as the FP8 form does, both slots would be held while one tile is computed
and no gather would be in flight: 1.04-1.20x slower on an H100, run AO). On an H100 (run AO):
1.00-2.21x FlashMLA bf16 over batch 1-128, ctx 1K-16K.

`MLADecodeConfig.pv_regs` (16 heads) drops the converter and the fp16 V ring: the attention
group reads each 16 tokens of the tile's e4m3 latent straight into registers (16-byte loads,
free of bank conflicts: `_v_regs_layout`), turns them to fp16 there and runs PV as fp16
wgmmas with that A operand from registers (`_pv_regs_step`). The latent columns are spread over
the A fragment's rows so that each thread's are contiguous in the ring (`_v_operand`; the
output goes back to the latent's order before its vector stores, `_latent_order`). A tile's
shared-memory traffic falls from about 234 KB to the cp.async copy, QK's read and this one
read of V (about 100 KB), and the freed 64 KB take a deeper e4m3 ring (up to 5 tiles). The
loop (`_pv_regs_loop`) runs the next tile's softmax while this tile's PV is on the tensor
cores. Same products as the fp16 copy: the same output.

Asked to (`MLADecodeConfig.merge_inside`), where the whole grid fits the SMs at once (one
program an SM) and the splits are few, the 16-head form merges the splits itself
(`_merge_here`): each program counts itself in on a per-(request, head group) counter once its
split is stored, and the first programs of the request then wait for the rest and each merge a
slice of the columns, so that no merge kernel follows (waiting on other programs is safe only
because all of them are resident). On an H100 the call is 0.2-1.9 us faster with it at 2-16
splits, but the engine's decode was 1.0-1.7% slower (perf/RESULTS.md, runs AS and AT: the
value projection after it then starts, with PDL, while this kernel still runs): opt-in.

Like the Triton kernels it is launched with programmatic dependent launch where the GPU has it
(`engine.kernels.launch`): its programs start while the previous kernel finishes, the loader
reads its first tile's slot ids, and each partition that reads q or the cache or writes its
output waits for that kernel first (`_pdl_wait`).

Gluon kernels compile for the GPU only (there is no interpreter): CPU runs use the Triton
kernel, and `tests/kernels/test_mla_decode_gluon.py` checks this one against the torch
reference on a Hopper GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels.launch import is_interpreter, launch
from engine.kernels.utils import split_bounds

# The gather into shared memory, by its Triton 3.9 name or its Triton 3.6 one.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# A barrier among the calling partition's warps, by its Triton 3.9 name or its Triton 3.6 one.
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

BLOCK_N = gl.constexpr(64)  # tokens a tile: M of the QK wgmma
BLOCK_H = gl.constexpr(16)  # heads a program (the default; 32 with `heads=32`): N of both wgmmas
CONVERT_ROWS = gl.constexpr(16)  # rows a converter step turns to fp16
CONVERTER_WARPS = gl.constexpr(4)
LOADER_REGS = gl.constexpr(80)
CONVERTER_REGS = gl.constexpr(96)
# With e4m3 PV: P in e4m3 times this (p <= 1, so at most 256 of e4m3's 448; a power of two).
P_SCALE = gl.constexpr(256.0)
TRANSPOSE_DIMS = gl.constexpr(128)  # latent columns a transposer step moves
# The transposer's loads, [64 tokens, 128 latent columns] over 4 warps: registers u (columns
# 0-1), k (tokens 3-4), g (token 5) and a column bit 6; lanes i (tokens 0-2) and q (columns
# 2-3); warps: columns 4-5 (`_transposer`).
TRANSPOSE_LAYOUT = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0], [16, 0], [32, 0], [0, 64]],
        lane_bases=[[1, 0], [2, 0], [4, 0], [0, 4], [0, 8]],
        warp_bases=[[0, 16], [0, 32]],
        block_bases=[],
        shape=[64, 128],
    )
)


V_STEP = gl.constexpr(16)  # tokens a register-V PV step takes: K of the fp16 wgmma


@triton.constexpr_function
def _v_own_bits(c: int) -> int:
    """Latent columns a thread holds (as bits) in the register-V operand (`_v_regs_layout`):
    rows of the [C, 16] A fragment per thread, 2 in each of the C / 64 M-blocks."""
    return c.bit_length() - 1 - 5


@triton.constexpr_function
def _v_regs_layout(c: int) -> gl.DistributedLinearLayout:
    """The layout in which the attention group loads V_STEP tokens [16, C] of a tile's e4m3
    latent for PV with V^T from registers (`_v_operand`): a thread takes 2^own contiguous
    latent columns (one 16-byte load at C = 512) of 4 tokens (t = 2 x lane bits 0-1 + 1 bit +
    8 x 1 bit), lanes' bits 2-4 and the warps the next column bits: after `_v_operand`'s
    relabelling these are the registers of the fp16 wgmma's A fragment [C, 16], row r holding
    latent column `_latent_order` undoes. A quarter warp reads 4 even rows x 2 16-byte
    chunks of a 128-byte swizzle atom: no bank conflicts (`gl.bank_conflicts`)."""
    own = _v_own_bits(c)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << j] for j in range(own)] + [[1, 0], [8, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 1 << own], [0, 2 << own], [0, 4 << own]],
        warp_bases=[[0, 8 << own], [0, 16 << own]],
        block_bases=[],
        shape=[16, c],
    )


@triton.constexpr_function
def _v8_regs_layout(c: int) -> gl.DistributedLinearLayout:
    """`_v_regs_layout` for PV as e4m3 wgmmas (`pv_regs` with `pv_e4m3`): a whole tile [64
    tokens, C] in the same bank-conflict-free pattern (token bits 1-2 in lanes 0-1, bits 0
    and 3-5 in registers; one 16-byte load a token row at C = 512). `_k8_order` then puts
    the tokens in the 8-bit A fragment's k order (k bits 2-3 in lanes 0-1): no lanes
    exchange data and nothing is converted; within a thread the bytes are transposed (a
    register loaded holds 4 columns of a token, the fragment's 4 tokens of a column: 3 PRMT
    an A register)."""
    own = _v_own_bits(c)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << j] for j in range(own)] + [[1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 1 << own], [0, 2 << own], [0, 4 << own]],
        warp_bases=[[0, 8 << own], [0, 16 << own]],
        block_bases=[],
        shape=[BLOCK_N, c],
    )


@triton.constexpr_function
def _v_out_layout(c: int) -> gl.DistributedLinearLayout:
    """The register-V accumulator [C, 16 heads] in the latent's order (`_latent_order`) with
    each thread's 2^own contiguous columns as its first registers, so that they are stored as
    16-byte vectors: a register permutation of what `_latent_order` gives."""
    own = _v_own_bits(c)
    return gl.DistributedLinearLayout(
        reg_bases=[[1 << j, 0] for j in range(own)] + [[0, 1], [0, 8]],
        lane_bases=[[0, 2], [0, 4], [1 << own, 0], [2 << own, 0], [4 << own, 0]],
        warp_bases=[[8 << own, 0], [16 << own, 0]],
        block_bases=[],
        shape=[c, 16],
    )


@gluon.jit
def _v_operand(x):
    """x [16 tokens, C] (`_v_regs_layout`, converted) as the A operand V^T [C, 16] of PV, a
    relabelling of the registers: latent column c = (warps, lanes, rest, first) from its
    highest bits goes to row (rest, warps, first, lanes) (`_latent_order` undoes it)."""
    C: gl.constexpr = x.shape[1]
    y = gl.reshape(x, [x.shape[0], 4, 8, C // 64, 2])
    y = gl.permute(y, (3, 1, 4, 2, 0))
    return gl.reshape(y, [C, x.shape[0]])


@gluon.jit
def _latent_order(acc):
    """acc [C, N] with its rows in `_v_operand`'s order (rest, warps, first, lanes) back in
    the latent's (warps, lanes, rest, first): a relabelling of the registers."""
    C: gl.constexpr = acc.shape[0]
    y = gl.reshape(acc, [C // 64, 4, 2, 8, acc.shape[1]])
    y = gl.permute(y, (1, 3, 0, 2, 4))
    return gl.reshape(y, [C, acc.shape[1]])


@gluon.jit
def _pdl_wait(USE_PDL: gl.constexpr):
    """The PDL contract's wait (`engine.kernels.launch`): from here on the previous launch has
    finished and its writes are visible; then the next launch may start. Each partition that
    reads what the last launches wrote (q, the newest latent row) or writes global memory
    calls it first."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@gluon.jit
def _program_tokens(seq_lens_ptr, row_idx_ptr, table_ptr, stride_table, num_splits,
                    HAS_ROW_IDX: gl.constexpr):  # fmt: skip
    """This program's head group, split and request (grid axes 0-2), its request's slot-table
    row, and the split's token range [start, end)."""
    hg = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    row, start, end = split_bounds(
        seq_lens_ptr, row_idx_ptr, b, split, num_splits, HAS_ROW_IDX, BLOCK_N
    )
    return hg, split, b, table_ptr + row * stride_table, start, end


@gluon.jit
def _n_tiles(start, end):
    return gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)


@gluon.jit
def _slots(table_row, n, offs, end, PAGE_SIZE: gl.constexpr, SLOT_TABLE: gl.constexpr):
    """Slot ids of the tile at n (tokens n + offs; 0 past `end`), and their mask. A tile never
    crosses a page: with pages its slots follow the first one (`mla_decode._page_slots`)."""
    pos = n + offs
    mask = pos < end
    if PAGE_SIZE == 1:
        slot = gl.load(table_row + pos, mask=mask, other=0).to(gl.int64)
    elif SLOT_TABLE:
        slot = gl.load(table_row + n, mask=n < end, other=0).to(gl.int64) + offs
    else:
        page = gl.load(table_row + n // PAGE_SIZE, mask=n < end, other=0).to(gl.int64)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
    return slot, mask


@gluon.jit
def _token_slot_ids(table_row, n, end):
    """Page size 1: the slot ids of the tile at n as the table holds them (int32; 0 past
    `end`), two a lane: 2 registers where the copies' layout (16 a lane) takes 16."""
    offs = gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0]))
    pos = n + offs
    return gl.load(table_row + pos, mask=pos < end, other=0)


@gluon.jit
def _loader(kv_ptr, table_row, start, end, stride_kv, lat_ring, pe_ring, kv_ready, kv_empty,
            PAGE_SIZE: gl.constexpr, SLOT_TABLE: gl.constexpr, USE_PDL: gl.constexpr,
            IDS_AHEAD: gl.constexpr = 1, WARPS: gl.constexpr = 1):  # fmt: skip
    """One warp (or WARPS, `launch_stage1`'s `loader_warps`, rows shared among them): per tile, wait
    for its ring slot to be free, gather its rows by slot id, and have the copies arrive on
    the slot's `kv_ready` barrier (each lane's own copies, counted).

    Eight lanes take a row's 128 bytes, 4 rows a step (against lane pairs on 32 bytes, 16 rows
    a step: 1.10x the loads' throughput on an H200, run AJ); a lane holds 16 of the tile's
    slot ids, read one tile ahead so that the copies never wait on them (at page size 1 with
    IDS_AHEAD 2, two tiles ahead, two int32 ids a lane until their tile spreads them). The
    rings may hold e4m3 or 16-bit elements (16 bytes a copy either way). The first tiles' slot
    ids (the step's inputs) are read before the PDL wait, the rows after it."""
    C: gl.constexpr = lat_ring.shape[2]
    R: gl.constexpr = pe_ring.shape[2]
    STAGES: gl.constexpr = lat_ring.shape[0]
    VEC: gl.constexpr = 128 // lat_ring.dtype.primitive_bitwidth
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [4, 8], [WARPS, 1], [1, 0])
    offs_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    offs_r = C + gl.arange(0, R, layout=gl.SliceLayout(0, layout))
    if IDS_AHEAD == 2 and PAGE_SIZE == 1:
        # NOTE: on an H200 the FP8 tile at page size 1 took 1.04-1.09x the paged one at batch
        # 64-128, ctx 4K-16K (run BA), where bf16 tiles (twice the bytes, twice the time) did
        # not: the one-tile-ahead id load may not be back within an FP8 tile's time there.
        ids = _token_slot_ids(table_row, start, end)
        ids_next = _token_slot_ids(table_row, start + BLOCK_N, end)
        _pdl_wait(USE_PDL)
        for i in range(_n_tiles(start, end)):
            s = i % STAGES
            n = start + i * BLOCK_N
            ids_after = _token_slot_ids(table_row, n + 2 * BLOCK_N, end)
            mbarrier.wait(kv_empty.index(s), ((i // STAGES) & 1) ^ 1)
            slot = gl.convert_layout(ids, offs_t.type.layout).to(gl.int64)
            _gather_tile(
                kv_ptr + slot[:, None] * stride_kv, n + offs_t < end, offs_c, offs_r,
                lat_ring.index(s), pe_ring.index(s), kv_ready.index(s),
            )  # fmt: skip
            ids = ids_next
            ids_next = ids_after
    else:
        _loader_one_ahead(
            kv_ptr, table_row, start, end, stride_kv, lat_ring, pe_ring, kv_ready, kv_empty,
            offs_t, offs_c, offs_r, PAGE_SIZE, SLOT_TABLE, USE_PDL,
        )  # fmt: skip


@gluon.jit
def _gather_tile(rows, mask, offs_c, offs_r, lat_slot, pe_slot, ready):
    """Copies of one tile's rows (`rows`: each row's address; masked rows zero-filled) into a
    ring slot, arriving on its `ready` barrier."""
    _async_load(lat_slot, rows + offs_c[None, :], mask=mask[:, None])
    _async_load(pe_slot, rows + offs_r[None, :], mask=mask[:, None])
    async_copy.mbarrier_arrive(ready, increment_count=False)


@gluon.jit
def _loader_one_ahead(kv_ptr, table_row, start, end, stride_kv, lat_ring, pe_ring, kv_ready,
                      kv_empty, offs_t, offs_c, offs_r, PAGE_SIZE: gl.constexpr,
                      SLOT_TABLE: gl.constexpr, USE_PDL: gl.constexpr):  # fmt: skip
    """`_loader`'s loop with each tile's slot ids read one tile ahead (as int64)."""
    STAGES: gl.constexpr = lat_ring.shape[0]
    slot, mask = _slots(table_row, start, offs_t, end, PAGE_SIZE, SLOT_TABLE)
    _pdl_wait(USE_PDL)
    for i in range(_n_tiles(start, end)):
        s = i % STAGES
        n = start + i * BLOCK_N
        next_slot, next_mask = _slots(table_row, n + BLOCK_N, offs_t, end, PAGE_SIZE, SLOT_TABLE)
        mbarrier.wait(kv_empty.index(s), ((i // STAGES) & 1) ^ 1)
        _gather_tile(
            kv_ptr + slot[:, None] * stride_kv, mask, offs_c, offs_r, lat_ring.index(s),
            pe_ring.index(s), kv_ready.index(s),
        )  # fmt: skip
        slot = next_slot
        mask = next_mask


@gluon.jit
def _converter(start, end, lat_ring, v_ring, kv_ready, kv_empty, v_ready, v_empty):
    """Four warps: per tile, the e4m3 latent turned into fp16 V ring slots of V_ROWS rows each
    (a slot signalled as soon as it is written); the e4m3 slot is then released (with the
    attention partition's QK). An e4m3 V ring takes the tile transposed instead
    (`_transposer`)."""
    if v_ring.dtype == gl.float8e4nv:
        _transposer(start, end, lat_ring, v_ring, kv_ready, kv_empty, v_ready, v_empty)
    else:
        _to_fp16(start, end, lat_ring, v_ring, kv_ready, kv_empty, v_ready, v_empty)


@gluon.jit
def _to_fp16(start, end, lat_ring, v_ring, kv_ready, kv_empty, v_ready, v_empty):
    STAGES: gl.constexpr = lat_ring.shape[0]
    V_STAGES: gl.constexpr = v_ring.shape[0]
    V_ROWS: gl.constexpr = v_ring.shape[1]
    CHUNKS: gl.constexpr = BLOCK_N // V_ROWS
    # NOTE: 8 bytes a thread, so that its fp16 copy is one 16-byte store: `gl.bank_conflicts`
    # (Triton 3.6) counts no excess wavefronts for the load and the store, against two
    # accesses a store wavefront with 16 bytes a thread (32-byte fp16 stores).
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    for i in range(_n_tiles(start, end)):
        s = i % STAGES
        mbarrier.wait(kv_ready.index(s), (i // STAGES) & 1)
        for j in gl.static_range(CHUNKS):
            g = i * CHUNKS + j
            t = g % V_STAGES
            mbarrier.wait(v_empty.index(t), ((g // V_STAGES) & 1) ^ 1)
            for r0 in gl.static_range(0, V_ROWS, CONVERT_ROWS):
                x = lat_ring.index(s).slice(j * V_ROWS + r0, CONVERT_ROWS).load(layout)
                v_ring.index(t).slice(r0, CONVERT_ROWS).store(x.to(gl.float16))
            # Every warp's stores reach the async proxy (the wgmma) before one thread signals.
            fence_async_shared()
            _barrier()
            mbarrier.arrive(v_ready.index(t))
        mbarrier.arrive(kv_empty.index(s))


@gluon.jit
def _transposer(start, end, lat_ring, vt_ring, kv_ready, kv_empty, v_ready, v_empty):
    """Four warps: per tile, the e4m3 latent [tokens, C] written as V^T [C, tokens] into the
    first 64 columns of a V^T ring slot [C, 128] (K-major, as an 8-bit wgmma operand must be),
    in e4m3: half the bytes of an fp16 copy, and no conversion.

    Each thread loads 4 bytes (4 latent columns) of 4 tokens and stores 4 bytes (4 tokens) of
    4 V^T rows, the bytes regrouped in registers. Lanes take tokens 8k + i (k = 0..3, i the
    lane's 3 low bits) so that a load's 8 lanes of a 16-byte column chunk hit the 8 rows of a
    128-byte swizzle atom; the V^T columns hold tokens in the order `_v_token_order` gives
    (P is stored in the same order), and the V^T rows the latent columns in the order
    `_v_rows_to_latent` undoes, so that the stores fill all 32 banks too: `gl.bank_conflicts`
    counts no excess wavefront either way (Triton 3.6). A row of 128 bytes (two tiles' width)
    keeps the 128-byte swizzle, which the 32-bank spread needs; the second half is unused."""
    STAGES: gl.constexpr = lat_ring.shape[0]
    V_STAGES: gl.constexpr = vt_ring.shape[0]
    C: gl.constexpr = lat_ring.shape[2]
    for i in range(_n_tiles(start, end)):
        s = i % STAGES
        t = i % V_STAGES
        mbarrier.wait(kv_ready.index(s), (i // STAGES) & 1)
        mbarrier.wait(v_empty.index(t), ((i // V_STAGES) & 1) ^ 1)
        for d0 in gl.static_range(0, C, TRANSPOSE_DIMS):
            x = lat_ring.index(s).slice(d0, TRANSPOSE_DIMS, dim=1).load(TRANSPOSE_LAYOUT)
            dst = vt_ring.index(t).slice(d0, TRANSPOSE_DIMS, dim=0).slice(0, BLOCK_N, dim=1)
            dst.store(_v_transposed(x))
        # Every warp's stores reach the async proxy (the wgmma) before one thread signals.
        fence_async_shared()
        _barrier()
        mbarrier.arrive(v_ready.index(t))
        mbarrier.arrive(kv_empty.index(s))


@gluon.jit
def _v_transposed(x):
    """x [64 tokens, 128 columns] as V^T [128 rows, 64 columns], a relabelling of the registers
    (no data moves between threads): the tokens in `_v_token_order`'s order (P's), and latent
    column d = 16D + 8q1 + 4q0 + 2u1 + u0 to row 16D + 8u1 + 4q1 + 2q0 + u0
    (`_v_rows_to_latent` inverts it)."""
    y = gl.reshape(_v_token_order(x), [x.shape[0], x.shape[1] // 16, 2, 2, 2, 2])
    # axes: 0 the tokens, 1 D, 2 q1, 3 q0, 4 u1, 5 u0
    y = gl.permute(y, (1, 4, 2, 3, 5, 0))
    return gl.reshape(y, [x.shape[1], x.shape[0]])


@gluon.jit
def _v_token_order(p):
    """p [64 tokens, N] with its tokens in the V^T ring's column order: token t = 32g + 16k1 +
    8k0 + 4i2 + 2i1 + i0 at 32g + 16i2 + 8i1 + 4i0 + 2k1 + k0 (`_v_transposed`, and P)."""
    y = gl.reshape(p, [2, 2, 2, 2, 2, 2, p.shape[1]])
    y = gl.permute(y, (0, 3, 4, 5, 1, 2, 6))
    return gl.reshape(y, [p.shape[0], p.shape[1]])


@gluon.jit
def _v_rows_to_latent(r):
    """The latent column that V^T row r holds (`_v_transposed`)."""
    u1 = (r >> 3) & 1
    q1 = (r >> 2) & 1
    q0 = (r >> 1) & 1
    return (r & ~15) | (q1 << 3) | (q0 << 2) | (u1 << 1) | (r & 1)


@gluon.jit
def _issue_qk(lat, pe, q_s, q_pe_s, zero):
    """QK^T of one tile [tokens, q rows] as one e4m3 wgmma chain, issued (not waited for)."""
    sq = warpgroup_mma(lat, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    return warpgroup_mma(pe, q_pe_s.permute((1, 0)), sq, is_async=True)


@gluon.jit
def _combine_terms(sq, s_layout: gl.constexpr, HEADS: gl.constexpr):
    """Scores [tokens, heads] from the QK chain's [tokens, q rows]: with q's two terms stacked
    (rows h and HEADS + h) the first plus the second / 16; at 16 heads a thread holds both
    (registers j and j + 2 of the m64n32 accumulator), so the split moves no data."""
    if sq.shape[1] == 2 * HEADS:
        main, res = gl.split(gl.permute(gl.reshape(sq, [BLOCK_N, 2, HEADS]), (0, 2, 1)))
        qk = gl.convert_layout(main + res * (1.0 / 16.0), s_layout)
    else:
        qk = sq
    return qk


# Two tokens' 4 e4m3 bytes of the same 4 latent columns ($4 the even token, $5 the odd one)
# as four fp16 pairs, each a column's two tokens (as the PV wgmma's A fragment holds them):
# PRMT pairs the bytes, then the conversion unit turns each pair.
_PAIRS_CVT = gl.constexpr(
    "{ .reg .b32 p, q; .reg .b16 pl, ph, ql, qh; "
    "prmt.b32 p, $4, $5, 0x5140; prmt.b32 q, $4, $5, 0x7362; "
    "mov.b32 {pl, ph}, p; mov.b32 {ql, qh}, q; "
    "cvt.rn.f16x2.e4m3x2 $0, pl; cvt.rn.f16x2.e4m3x2 $1, ph; "
    "cvt.rn.f16x2.e4m3x2 $2, ql; cvt.rn.f16x2.e4m3x2 $3, qh; }"
)


@gluon.jit
def _v_pairs_f16(x):
    """x [16 tokens, C] e4m3 (`_v_regs_layout`) in fp16 with each register a token pair of one
    latent column, as the A fragment takes them: the bytes paired by PRMT before the
    conversion (`_PAIRS_CVT`; converted first, every fp16 pair took a PRMT more: 32 PRMT a
    thread a step against 16)."""
    T: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    even, odd = gl.split(gl.permute(gl.reshape(x, [T // 2, 2, C]), (0, 2, 1)))
    lo, hi = gl.inline_asm_elementwise(
        asm=_PAIRS_CVT,
        constraints="=r,=r,=r,=r,r,r",
        args=[even.to(gl.uint8, bitcast=True), odd.to(gl.uint8, bitcast=True)],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=4,
    )
    # lo[u, 4g + j] holds token 2u + (j & 1) of column 4g + (j >> 1), hi the columns 4g + 2
    # and 4g + 3: axes (u, g, jh, jl, s) to (u, jl, g, s, jh).
    y = gl.reshape(gl.join(lo, hi), [T // 2, C // 4, 2, 2, 2])
    return gl.reshape(gl.permute(y, (0, 3, 1, 4, 2)), [T, C])


@gluon.jit
def _pv_regs_step(v_tile, k, p_s, acc, o_layout: gl.constexpr):
    """PV over tokens [k x V_STEP, (k + 1) x V_STEP) of the e4m3 slot v_tile [BLOCK_N, C],
    V^T from registers (`_v_regs_layout`, `_v_pairs_f16`, `_v_operand`), issued (not waited
    for); returns the accumulator's token and the A operand, which must stay alive until the
    wgmma is done."""
    C: gl.constexpr = v_tile.shape[1]
    x = v_tile.slice(k * V_STEP, V_STEP).load(_v_regs_layout(C))
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    a = gl.convert_layout(_v_operand(_v_pairs_f16(x)), a_layout)
    p_k = p_s.slice(k * V_STEP, V_STEP, dim=1).permute((1, 0))
    return warpgroup_mma(a, p_k, acc, is_async=True), a


@gluon.jit
def _online_softmax(sq, valid, scale, m_i, s_layout: gl.constexpr, HEADS: gl.constexpr):
    """The online softmax of a tile (scores `sq` from the QK chain; the tokens where `valid`
    is false masked): returns P [tokens, heads], the new running max, and the factor that
    rescales what was accumulated before (the running sum is the caller's: e4m3 PV sums the
    rounded P)."""
    qk = _combine_terms(sq, s_layout, HEADS)
    qk = gl.where(valid[:, None], qk * scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk - m_new[None, :])
    return p, m_new, alpha


@gluon.jit
def _pv_regs_tile(v_tile, p_i, acc, alpha, o_layout: gl.constexpr):
    """A tile's PV with V^T from registers: the accumulator rescaled by `alpha`, then four
    `_pv_regs_step`s, or over an e4m3 P (p_i) `_pv8_regs_tile`'s e4m3 wgmmas, issued (not
    waited for); returns the accumulator's token and the A operands that must stay alive until
    the wgmmas are done (`_pv_regs_wait`; over e4m3 none can be named, see there)."""
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))[None, :]
    if p_i.dtype == gl.float8e4nv:
        return _pv8_regs_tile(v_tile, p_i, acc, o_layout), ()
    else:
        acc, a0 = _pv_regs_step(v_tile, 0, p_i, acc, o_layout)
        acc, a1 = _pv_regs_step(v_tile, 1, p_i, acc, o_layout)
        acc, a2 = _pv_regs_step(v_tile, 2, p_i, acc, o_layout)
        acc, a3 = _pv_regs_step(v_tile, 3, p_i, acc, o_layout)
        return acc, (a0, a1, a2, a3)


@gluon.jit
def _pv_regs_wait(acc, ops):
    """Waits for `_pv_regs_tile`'s wgmmas (and everything issued before them); returns the
    accumulator.

    NOTE: over e4m3 `ops` is empty: Triton 3.6 cannot list an 8-bit operand among a wait's
    deps ("Unexpected bitwidth in WGMMAWaitGroupOp"). Nor would it help: the wgmma's A
    registers are the bytes packed anew by its lowering, which no dep names (in the fp16 form
    either); no A register is redefined before the wait in the PTX, and ptxas keeps them or
    serializes the wgmmas (the census checks it does not)."""
    if len(ops) == 0:
        acc = warpgroup_mma_wait(0, deps=(acc,))
    else:
        acc, _, _, _, _ = warpgroup_mma_wait(0, deps=(acc, ops[0], ops[1], ops[2], ops[3]))
    return acc


@gluon.jit
def _k8_order(x):
    """x [64 tokens, N] with its tokens in PV's e4m3 k order: row k holds token t(k), t's bits
    (5, 4, 3, 2, 1, 0) being k's (5, 4, 1, 3, 2, 0), so that `_v8_regs_layout`'s lane bits
    (token bits 1-2) become k bits 2-3 as the 8-bit A fragment holds them. V's tokens and
    P's go through it alike (PV sums over k in any order); a relabelling of the registers."""
    N: gl.constexpr = x.shape[1]
    y = gl.reshape(x, [2, 2, 2, 2, 2, 2, N])
    return gl.reshape(gl.permute(y, (0, 1, 3, 4, 2, 5, 6)), [BLOCK_N, N])


@gluon.jit
def _pv8_regs_tile(v_tile, p_i, acc, o_layout: gl.constexpr):
    """A tile's PV as e4m3 wgmmas (m64n16k32, 8 M-blocks x 2 k-steps) with V^T read from the
    e4m3 slot v_tile [BLOCK_N, C] into registers (`_v8_regs_layout`, `_k8_order`) and P^T in
    e4m3 from p_i [HEADS, BLOCK_N] (times P_SCALE, its tokens in `_k8_order` too), issued
    (not waited for); returns the accumulator's token."""
    C: gl.constexpr = v_tile.shape[1]
    x = _k8_order(v_tile.load(_v8_regs_layout(C)))
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    a = gl.convert_layout(_v_operand(x), a_layout, assert_trivial=True)
    return warpgroup_mma(a, p_i.permute((1, 0)), acc, is_async=True)


@triton.constexpr_function
def _warp_rows_layout(heads: int) -> gl.DistributedLinearLayout:
    """[4 warps' rows, heads] with every thread holding the 4 rows of the heads it holds in
    the wgmma accumulator (m64n16: heads 2 x lane bits 0-1 + register bit 0 + 8 x register
    bit 1)."""
    assert heads == 16
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 8], [1, 0], [2, 0]],
        lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]],
        block_bases=[],
        shape=[4, heads],
    )


@gluon.jit
def _tile_softmax(sq, valid, scale, m_i, buf, s_layout: gl.constexpr, HEADS: gl.constexpr):
    """`_online_softmax` with the tile's max across the 4 warps through one barrier: each warp
    reduces its own 16 tokens with shuffles, writes its [HEADS] maxima to buf [4, HEADS] (the
    caller alternates two, so that the next tile's writes never meet this tile's reads) and,
    after the barrier, every thread reads the 4 rows of its heads (Triton's reduce across
    warps takes three barriers and two shared-memory round trips: 1.12-1.15x slower where the
    kernel is held by its work, perf/RESULTS.md, run AW)."""
    qk = _combine_terms(sq, s_layout, HEADS)
    qk = gl.where(valid[:, None], qk * scale, float("-inf"))
    w = gl.max(gl.reshape(qk, [4, BLOCK_N // 4, HEADS]), 1)
    buf.store(w)
    _barrier()
    m_tile = gl.convert_layout(gl.max(buf.load(_warp_rows_layout(HEADS)), 0), m_i.type.layout)
    m_new = gl.maximum(m_i, m_tile)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk - m_new[None, :])
    return p, m_new, alpha


@triton.constexpr_function
def _s_layout(heads: int, qk_k: int) -> gl.NVMMADistributedLayout:
    """Scores [BLOCK_N tokens, heads] as the QK wgmma (K = qk_k) of one warp group leaves them."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, heads, qk_k]
    )


@triton.constexpr_function
def _o_layout(heads: int, pv_k: int) -> gl.NVMMADistributedLayout:
    """The output [C, heads] as the PV wgmma (K = pv_k) of one warp group accumulates it."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, heads, pv_k]
    )


@gluon.jit
def _publish_p(p, l_t, alpha, dst):
    """A tile's P [BLOCK_N, HEADS] into dst [HEADS, BLOCK_N] in its dtype (e4m3: times
    P_SCALE, the tokens in `_k8_order`) and the per-thread running sums l_t rescaled by
    `alpha` and updated (over e4m3, with the rounded P: what PV sums)."""
    if dst.dtype == gl.float8e4nv:
        p8 = (p * P_SCALE).to(gl.float8e4nv)
        l_t = l_t * alpha[None, :] + p8.to(gl.float32) * (1.0 / P_SCALE)
        dst.store(gl.permute(_k8_order(p8), (1, 0)))
    else:
        l_t = l_t * alpha[None, :] + p
        dst.store(gl.permute(p.to(gl.float16), (1, 0)))
    return l_t


@gluon.jit
def _pv_regs_loop(lat_ring, pe_ring, q_s, q_pe_s, p_s, m_s, kv_ready, kv_empty, start, end,
                  scale, zero, acc, m_i):  # fmt: skip
    """The attention group's tiles with V^T from registers (`pv_regs`; P buffers p_s [2, HEADS,
    BLOCK_N], the softmax's m_s [2, 4, HEADS]): per tile but the last, QK of the next tile is
    issued, then this tile's PV (`_pv_regs_tile`, P from the softmax before; with p_s in e4m3
    as e4m3 wgmmas), and while PV runs on the tensor cores the next tile's softmax
    (`_tile_softmax`) fills the other P buffer; the last tile's PV follows the loop. All of a
    tile's wgmmas are waited for inside its iteration (a wgmma left in flight across the
    loop's back edge made ptxas serialize every wgmma). A ring slot goes back to the loader
    once every warp has read its V (the last one never: no tile follows it). The running sums
    are kept per thread and summed across the warps once, at the end. An empty split's QK and
    PV run on a stale slot, their results never stored. Returns the accumulator, the running
    max and the sums."""
    HEADS: gl.constexpr = p_s.shape[1]
    STAGES: gl.constexpr = lat_ring.shape[0]
    P8: gl.constexpr = p_s.dtype == gl.float8e4nv
    s_layout: gl.constexpr = _s_layout(HEADS, 32)
    o_layout: gl.constexpr = _o_layout(HEADS, 32 if P8 else 16)
    n_tiles = _n_tiles(start, end)
    offs_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    l_t = gl.zeros([BLOCK_N, HEADS], gl.float32, s_layout)
    mbarrier.wait(kv_ready.index(0), 0, pred=n_tiles > 0)
    fence_async_shared()
    sq = warpgroup_mma_wait(
        0, deps=(_issue_qk(lat_ring.index(0), pe_ring.index(0), q_s, q_pe_s, zero),)
    )
    p, m_i, alpha = _tile_softmax(
        sq, start + offs_t < end, scale, m_i, m_s.index(0), s_layout, HEADS
    )
    l_t = _publish_p(p, l_t, alpha, p_s.index(0))
    fence_async_shared()
    _barrier()
    for i in range(n_tiles - 1):
        s1 = (i + 1) % STAGES
        mbarrier.wait(kv_ready.index(s1), ((i + 1) // STAGES) & 1)
        fence_async_shared()
        next_sq = _issue_qk(lat_ring.index(s1), pe_ring.index(s1), q_s, q_pe_s, zero)
        acc, ops = _pv_regs_tile(lat_ring.index(i % STAGES), p_s.index(i % 2), acc, alpha, o_layout)
        # The slot goes back as soon as every warp holds its V, so that the loader keeps as
        # many tiles in flight as it can (released after the next softmax instead, one
        # program over 64K tokens took 1640 us on an H100, run AU).
        _barrier()
        mbarrier.arrive(kv_empty.index(i % STAGES))
        # QK (two groups, issued first) is done; PV's (one group over e4m3, else four) may
        # still run.
        sq = warpgroup_mma_wait(1 if P8 else 4, deps=(next_sq,))
        valid = start + (i + 1) * BLOCK_N + offs_t < end
        p, m_i, alpha = _tile_softmax(
            sq, valid, scale, m_i, m_s.index((i + 1) % 2), s_layout, HEADS
        )
        l_t = _publish_p(p, l_t, alpha, p_s.index((i + 1) % 2))
        fence_async_shared()
        _barrier()
        acc = _pv_regs_wait(acc, ops)
    last = gl.maximum(n_tiles - 1, 0)
    acc, ops = _pv_regs_tile(
        lat_ring.index(last % STAGES), p_s.index(last % 2), acc, alpha, o_layout
    )
    acc = _pv_regs_wait(acc, ops)
    return acc, m_i, gl.sum(l_t, 0)


@gluon.jit
def _attend(q_base, stride_qh, qk_scale, k_scale_ptr, q_s, q_pe_s, p_s, lat_ring, pe_ring,
            v_ring, kv_ready, kv_empty, v_ready, v_empty, mid_o_ptr, mid_lse_ptr, b, split, hg,
            start, end, num_heads,
            stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
            out_ptr, counter_ptr, stride_ob, stride_oh, num_splits,
            MERGE_CHUNKS: gl.constexpr, MERGE_S_PAD: gl.constexpr,
            USE_PDL: gl.constexpr, PV_REGS: gl.constexpr, m_s):  # fmt: skip
    """One warp group: q in e4m3 (`_quantize_q`), then scores, online softmax and PV per tile;
    then the split's output (normalized, times the cache's scale) and log-sum-exp (log2
    units), as `store_split` writes them. PV runs in fp16 from the fp16 V ring, or over an
    e4m3 V^T ring (`_transposer`) as an e4m3 wgmma with P in e4m3 (times P_SCALE; the row sums
    are of the rounded P, so that the normalization matches what PV summed)."""
    # NOTE: q is read and quantized here, not before the partitions start, so that the
    # loader's first gathers are in flight while q loads.
    _pdl_wait(USE_PDL)
    HEADS: gl.constexpr = p_s.shape[-2]
    # A 16-bit cache (`SIXTEEN`): q as it is, no scales, and V the ring's own latent.
    SIXTEEN: gl.constexpr = lat_ring.dtype != gl.float8e4nv
    if SIXTEEN:
        _stage_q(q_base, stride_qh, hg, num_heads, q_s, q_pe_s, HEADS)
        out_scale = 1.0
        scale = qk_scale
    else:
        q_mul = _quantize_q(q_base, stride_qh, hg, num_heads, q_s, q_pe_s, HEADS)
        out_scale = gl.load(k_scale_ptr)
        scale = qk_scale * out_scale / q_mul
    C: gl.constexpr = lat_ring.shape[2]
    STAGES: gl.constexpr = lat_ring.shape[0]
    V_STAGES: gl.constexpr = v_ring.shape[0]
    PV8: gl.constexpr = p_s.dtype == gl.float8e4nv  # P, and so PV, in e4m3
    V_ROWS: gl.constexpr = BLOCK_N if PV8 or SIXTEEN or PV_REGS else v_ring.shape[1]
    CHUNKS: gl.constexpr = BLOCK_N // V_ROWS
    QK_K: gl.constexpr = 16 if SIXTEEN else 32  # K of the QK wgmma instruction
    s_layout: gl.constexpr = _s_layout(HEADS, QK_K)
    o_layout: gl.constexpr = _o_layout(HEADS, 32 if PV8 else 16)
    m_i = gl.full([HEADS], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
    l_i = gl.zeros([HEADS], gl.float32, gl.SliceLayout(0, s_layout))
    acc = gl.zeros([C, HEADS], gl.float32, o_layout)
    Q_ROWS: gl.constexpr = q_s.shape[0]
    sq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, Q_ROWS, QK_K]
    )
    zero = gl.zeros([BLOCK_N, Q_ROWS], gl.float32, sq_layout)
    offs_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    n_tiles = _n_tiles(start, end)
    # NOTE: over an e4m3 ring QK of the next tile is issued before this tile's softmax, so that
    # the tensor cores work while the warps compute (1.03-1.05x at batch 16 and 128, ctx 16K,
    # run AJ); its result is waited for with this tile's PV. The last iteration issues a QK on
    # a stale slot, skipping its wait, and never uses it. A 16-bit slot is held until PV is
    # done, so there it would hold both slots of the ring and stop the gathers while a tile is
    # computed: each tile's QK follows its own wait instead, the next tile loading meanwhile
    # (1.04-1.20x, run AO). The ring is written by cp.async (the generic proxy) and read by the
    # wgmma (the async proxy): a proxy fence after each wait.
    if PV_REGS:
        acc, m_i, l_i = _pv_regs_loop(
            lat_ring, pe_ring, q_s, q_pe_s, p_s, m_s, kv_ready, kv_empty, start, end, scale,
            zero, acc, m_i,
        )  # fmt: skip
    else:
        QK_AHEAD: gl.constexpr = not SIXTEEN
        if QK_AHEAD:
            mbarrier.wait(kv_ready.index(0), 0, pred=n_tiles > 0)
            fence_async_shared()
            sq = warpgroup_mma_wait(
                0, deps=(_issue_qk(lat_ring.index(0), pe_ring.index(0), q_s, q_pe_s, zero),)
            )
        for i in range(n_tiles):
            if QK_AHEAD:
                mbarrier.arrive(kv_empty.index(i % STAGES))  # V is the converter's copy
                s1 = (i + 1) % STAGES
                mbarrier.wait(kv_ready.index(s1), ((i + 1) // STAGES) & 1, pred=i + 1 < n_tiles)
                fence_async_shared()
                next_sq = _issue_qk(lat_ring.index(s1), pe_ring.index(s1), q_s, q_pe_s, zero)
            else:
                s0 = i % STAGES
                mbarrier.wait(kv_ready.index(s0), (i // STAGES) & 1)
                fence_async_shared()
                sq = warpgroup_mma_wait(
                    0, deps=(_issue_qk(lat_ring.index(s0), pe_ring.index(s0), q_s, q_pe_s, zero),)
                )
            valid = start + i * BLOCK_N + offs_t < end
            p, m_new, alpha = _online_softmax(sq, valid, scale, m_i, s_layout, HEADS)
            if PV8:
                p8 = (p * P_SCALE).to(gl.float8e4nv)
                l_i = l_i * alpha + gl.sum(p8.to(gl.float32), 0) * (1.0 / P_SCALE)
                p_s.store(gl.permute(_v_token_order(p8), (1, 0)))
            else:
                l_i = l_i * alpha + gl.sum(p, 0)
                p_s.store(gl.permute(p.to(p_s.dtype), (1, 0)))
            m_i = m_new
            fence_async_shared()
            _barrier()
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))[None, :]
            if SIXTEEN:
                # V^T [C, tokens] is the ring slot's latent read MN-major; the slot goes back to
                # the loader once PV is done.
                v_t = lat_ring.index(i % STAGES).permute((1, 0))
                acc = warpgroup_mma(v_t, p_s.permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(i % STAGES))
            else:
                # PV a V slot at a time (tokens j * V_ROWS on), each slot released once its
                # wgmma and the ones before it are done, so that the converter can refill it
                # during the rest.
                for j in gl.static_range(CHUNKS):
                    g = i * CHUNKS + j
                    mbarrier.wait(v_ready.index(g % V_STAGES), (g // V_STAGES) & 1)
                    p_j = p_s.slice(j * V_ROWS, V_ROWS, dim=1)
                    if PV8:
                        v_j = v_ring.index(g % V_STAGES).slice(0, BLOCK_N, dim=1)  # V^T [C, tokens]
                    else:
                        v_j = v_ring.index(g % V_STAGES).permute((1, 0))
                    acc = warpgroup_mma(v_j, p_j.permute((1, 0)), acc, is_async=True)
                    if j > 0:
                        # (QK's group, issued first, is done too; its result is taken below.)
                        warpgroup_mma_wait(1, deps=(next_sq,))
                        mbarrier.arrive(v_empty.index((g - 1) % V_STAGES))
                sq, acc = warpgroup_mma_wait(0, deps=(next_sq, acc))
                mbarrier.arrive(v_empty.index((i * CHUNKS + CHUNKS - 1) % V_STAGES))

    offs_h = hg * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(0, s_layout))
    lse_ptrs = mid_lse_ptr + b.to(gl.int64) * stride_mlb + offs_h * stride_mlh + split
    if end > start:
        gl.store(lse_ptrs, m_i + gl.log2(l_i), mask=offs_h < num_heads)
        pv_scale: gl.constexpr = P_SCALE if PV8 else 1.0
        inv = gl.convert_layout(out_scale / (l_i * pv_scale), gl.SliceLayout(0, o_layout))
        out = acc * inv[None, :]
        if PV_REGS:
            # Back to the latent's order: each thread then holds 2^own contiguous columns of
            # each of its heads (vector stores; scattered 4-byte ones cost about 4 us a
            # program on an H100).
            out = gl.convert_layout(_latent_order(out), _v_out_layout(C))
        out_layout: gl.constexpr = out.type.layout
        offs_c = gl.arange(0, C, layout=gl.SliceLayout(1, out_layout))
        if PV8 and not PV_REGS:
            offs_c = _v_rows_to_latent(offs_c)
        offs_ho = hg * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(0, out_layout))
        o_ptrs = (
            mid_o_ptr + b.to(gl.int64) * stride_mob + offs_ho[None, :] * stride_moh
            + split * stride_mos + offs_c[:, None]
        )  # fmt: skip
        gl.store(o_ptrs, out.to(mid_o_ptr.dtype.element_ty), mask=(offs_ho < num_heads)[None, :])
    else:
        empty = gl.full([HEADS], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
        gl.store(lse_ptrs, empty, mask=offs_h < num_heads)
    if MERGE_CHUNKS > 0:
        _merge_here(
            mid_o_ptr, mid_lse_ptr, out_ptr, counter_ptr + b * gl.num_programs(0) + hg, b, split,
            hg, num_heads, num_splits, stride_mob, stride_moh, stride_mos, stride_mlb,
            stride_mlh, stride_ob, stride_oh, HEADS, C, MERGE_CHUNKS, MERGE_S_PAD,
        )  # fmt: skip


@gluon.jit
def _merge_here(mid_o_ptr, mid_lse_ptr, out_ptr, counter, b, split, hg, num_heads, num_splits,
                stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                HEADS: gl.constexpr, C: gl.constexpr, CHUNKS: gl.constexpr,
                S_PAD: gl.constexpr):  # fmt: skip
    """The split merge inside stage 1 (`merge_splits`' arithmetic): each program of a (request,
    head group) counts itself in on `counter` once its split is stored; the first CHUNKS of
    them then wait until all `num_splits` have, and each merges its own C // CHUNKS columns of
    every head into the output. The last of those sets the counter back to 0 for the next
    launch. Waiting inside a kernel is safe only while every program of the grid is resident
    at once: `mla_decode._launch` asks for this only when the grid fits the SMs (one program
    an SM), and the dependent launch starts only after every program has begun."""
    # Every warp's stores of this split are done before one thread publishes them (the
    # release is cumulative over what the barrier ordered before it).
    _barrier()
    gl.atomic_add(counter, 1, sem="release", scope="gpu")
    if split < CHUNKS:
        seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        while seen < num_splits:
            seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        W: gl.constexpr = C // CHUNKS
        VEC: gl.constexpr = 4 if W >= 4 else W
        TW: gl.constexpr = 32 if W // VEC >= 32 else W // VEC
        TS: gl.constexpr = 32 // TW if 32 // TW <= S_PAD else S_PAD
        layout: gl.constexpr = gl.BlockedLayout(
            [1, 1, VEC], [32 // (TW * TS), TS, TW], [gl.num_warps(), 1, 1], [2, 1, 0]
        )
        hs: gl.constexpr = gl.SliceLayout(2, layout)  # [heads, splits]
        hc: gl.constexpr = gl.SliceLayout(1, layout)  # [heads, columns]
        offs_h = hg * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, hs))
        offs_s = gl.arange(0, S_PAD, layout=gl.SliceLayout(0, hs))
        offs_c = split * W + gl.arange(0, W, layout=gl.SliceLayout(0, hc))
        lse_ptrs = (
            mid_lse_ptr + b.to(gl.int64) * stride_mlb + offs_h[:, None] * stride_mlh
            + offs_s[None, :]
        )  # fmt: skip
        lse_mask = (offs_h < num_heads)[:, None] & (offs_s < num_splits)[None, :]
        # NOTE: ".cg": the other programs' rows are read from L2, never from this SM's L1.
        lse = gl.load(lse_ptrs, mask=lse_mask, other=float("-inf"), cache_modifier=".cg")
        m = gl.max(lse, 1)  # finite for a real head: split 0 always holds a token
        w = gl.exp2(lse - m[:, None])  # 0 for an empty split (its rows are never written)
        o_ptrs = (
            mid_o_ptr + b.to(gl.int64) * stride_mob + offs_h[:, None, None] * stride_moh
            + offs_s[None, :, None] * stride_mos + offs_c[None, None, :]
        )  # fmt: skip
        rows = gl.load(o_ptrs, mask=(w > 0.0)[:, :, None], other=0.0, cache_modifier=".cg")
        acc = gl.sum(w[:, :, None] * rows, 1)
        denom = gl.convert_layout(gl.sum(w, 1), gl.SliceLayout(1, hc))
        offs_ho = hg * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, hc))
        out_ptrs = (
            out_ptr + b.to(gl.int64) * stride_ob + offs_ho[:, None] * stride_oh
            + offs_c[None, :]
        )  # fmt: skip
        out = acc / denom[:, None]
        gl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(offs_ho < num_heads)[:, None])
        done = gl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
        if done == num_splits + CHUNKS - 1:
            gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _load_q(q_base, rows, mask_h, col0, WIDTH: gl.constexpr, layout: gl.constexpr):
    """q's [len(rows), WIDTH] columns from col0 (row offsets `rows`) in fp32, and their
    absolute maximum."""
    offs_c = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    x = gl.load(q_base + rows[:, None] + offs_c[None, :], mask=mask_h[:, None], other=0.0)
    x = x.to(gl.float32)
    return x, gl.max(gl.max(gl.abs(x), 1), 0)


@gluon.jit
def _quantize_q(q_base, stride_qh, hg, num_heads, q_s, q_pe_s, HEADS: gl.constexpr):
    """q of the head group in e4m3 into q_s / q_pe_s (the QK wgmma's B), one scale for its
    heads; returns that scale (448 / max |q|). With 2 x HEADS rows the second HEADS hold
    q's second term. The calling partition's warps share the work and then the fence."""
    C: gl.constexpr = q_s.shape[1]
    R: gl.constexpr = q_pe_s.shape[1]
    Q_ROWS: gl.constexpr = q_s.shape[0]
    lat_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    pe_layout: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 * 8 // R, R // 8], [gl.num_warps(), 1], [1, 0]
    )
    heads_l = hg * HEADS + gl.arange(0, Q_ROWS, layout=gl.SliceLayout(1, lat_layout)) % HEADS
    heads_p = hg * HEADS + gl.arange(0, Q_ROWS, layout=gl.SliceLayout(1, pe_layout)) % HEADS
    q_lat, amax_lat = _load_q(q_base, heads_l * stride_qh, heads_l < num_heads, 0, C, lat_layout)
    q_pe, amax_pe = _load_q(q_base, heads_p * stride_qh, heads_p < num_heads, C, R, pe_layout)
    q_mul = 448.0 / gl.maximum(gl.maximum(amax_lat, amax_pe), 1e-30)
    _store_q(q_lat, q_mul, q_s, HEADS)
    _store_q(q_pe, q_mul, q_pe_s, HEADS)
    # The stores reach the async proxy (the wgmma) before any warp of the group issues one.
    fence_async_shared()
    _barrier()
    return q_mul


@gluon.jit
def _stage_q(q_base, stride_qh, hg, num_heads, q_s, q_pe_s, HEADS: gl.constexpr):
    """q of the head group as it is (16 bits) into q_s / q_pe_s (the QK wgmma's B); the calling
    partition's warps share the work and then the fence."""
    C: gl.constexpr = q_s.shape[1]
    R: gl.constexpr = q_pe_s.shape[1]
    lat_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    pe_layout: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 * 8 // R, R // 8], [gl.num_warps(), 1], [1, 0]
    )
    heads_l = hg * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, lat_layout))
    heads_p = hg * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, pe_layout))
    q_lat, _ = _load_q(q_base, heads_l * stride_qh, heads_l < num_heads, 0, C, lat_layout)
    q_pe, _ = _load_q(q_base, heads_p * stride_qh, heads_p < num_heads, C, R, pe_layout)
    q_s.store(q_lat.to(q_s.dtype))
    q_pe_s.store(q_pe.to(q_pe_s.dtype))
    fence_async_shared()
    _barrier()


@gluon.jit
def _store_q(x, q_mul, dst, HEADS: gl.constexpr):
    """x * q_mul in e4m3 into dst; with 2 x HEADS rows (x's rows again) the rows from
    HEADS on hold 16x the first rows' rounding error instead."""
    y = x * q_mul
    y8 = y.to(gl.float8e4nv)
    if x.shape[0] == 2 * HEADS:
        res8 = ((y - y8.to(gl.float32)) * 16.0).to(gl.float8e4nv)
        second = gl.arange(0, x.shape[0], layout=gl.SliceLayout(1, x.type.layout)) >= HEADS
        y8 = gl.where(second[:, None], res8, y8)
    dst.store(y8)


@gluon.jit
def mla_decode_fp8_ws_kernel(
    q_ptr,  # [B, H, C + R]
    kv_ptr,  # [num_slots, C + R] e4m3 (row stride given)
    table_ptr,  # [rows, cols] int32: slot ids per position (SLOT_TABLE) or page ids
    row_idx_ptr,  # [B] table row per request (only when HAS_ROW_IDX)
    seq_lens_ptr,  # [B]
    mid_o_ptr,  # [B, H, S, C] fp32, or the output [B, H, 1, C] when S == 1
    mid_lse_ptr,  # [B, H, S] fp32 (log2 units)
    qk_scale,  # sm_scale * log2(e)
    k_scale_ptr,  # [1] fp32
    stride_qb, stride_qh, stride_kv, stride_table,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    num_heads, num_splits,
    out_ptr,  # [B, H, C] with MERGE_CHUNKS (the merged output), else unused
    counter_ptr,  # [B x head groups] int32, zero between launches (with MERGE_CHUNKS)
    stride_ob, stride_oh,
    C: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr, SLOT_TABLE: gl.constexpr,
    HAS_ROW_IDX: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
    V_ROWS: gl.constexpr, Q_RESIDUAL: gl.constexpr, HEADS: gl.constexpr,
    PV_E4M3: gl.constexpr = False, MERGE_CHUNKS: gl.constexpr = 0, MERGE_S_PAD: gl.constexpr = 1,
    USE_PDL: gl.constexpr = False, PV_REGS: gl.constexpr = False, IDS_AHEAD: gl.constexpr = 1,
    LOADER_WARPS: gl.constexpr = 1,
):  # fmt: skip
    hg, split, b, table_row, start, end = _program_tokens(
        seq_lens_ptr, row_idx_ptr, table_ptr, stride_table, num_splits, HAS_ROW_IDX
    )

    # NOTE: with Q_RESIDUAL q's two terms are the stacked rows of one operand
    # [2 x HEADS, C + R] (terms of head h in rows h and HEADS + h): QK is one m64n32 (m64n64
    # at 32 heads) wgmma chain, each tile read once from shared memory.
    Q_ROWS: gl.constexpr = 2 * HEADS if Q_RESIDUAL else HEADS
    q_base = q_ptr + b.to(gl.int64) * stride_qb

    e4m3_128: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8)
    e4m3_pe: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=R, element_bitwidth=8)
    f16_128: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16)
    # A 16-bit cache: q, the ring and P in its dtype, and no converter (V is the ring's latent).
    SIXTEEN: gl.constexpr = kv_ptr.dtype.element_ty != gl.float8e4nv
    if SIXTEEN:
        kv_t: gl.constexpr = kv_ptr.dtype.element_ty
        pe_16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * R, element_bitwidth=16)
        q_s = gl.allocate_shared_memory(kv_t, [HEADS, C], f16_128)
        q_pe_s = gl.allocate_shared_memory(kv_t, [HEADS, R], pe_16)
        lat_ring = gl.allocate_shared_memory(kv_t, [STAGES, BLOCK_N, C], f16_128)
        pe_ring = gl.allocate_shared_memory(kv_t, [STAGES, BLOCK_N, R], pe_16)
    else:
        q_s = gl.allocate_shared_memory(gl.float8e4nv, [Q_ROWS, C], e4m3_128)
        q_pe_s = gl.allocate_shared_memory(gl.float8e4nv, [Q_ROWS, R], e4m3_pe)
        lat_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, C], e4m3_128)
        pe_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, R], e4m3_pe)
    # The register-V form's softmax buffers (`_tile_softmax`); 512 bytes, allocated in every
    # form so that the partitions' argument lists stay the same.
    m_s = gl.allocate_shared_memory(
        gl.float32, [2, 4, HEADS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    )
    if SIXTEEN:
        p_s = gl.allocate_shared_memory(kv_t, [HEADS, BLOCK_N], f16_128)
        v_ring = lat_ring
    elif PV_REGS:
        # V is read from the e4m3 ring into registers by the attention group: no V ring; P
        # double-buffered (a tile's PV runs on during the next softmax), in e4m3 with PV_E4M3.
        if PV_E4M3:
            e4m3_p8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8)
            p_s = gl.allocate_shared_memory(gl.float8e4nv, [2, HEADS, BLOCK_N], e4m3_p8)
        else:
            p_s = gl.allocate_shared_memory(gl.float16, [2, HEADS, BLOCK_N], f16_128)
        v_ring = lat_ring
    elif PV_E4M3:
        # NOTE: V^T slots of 128 columns (one tile in the first 64): the 128-byte swizzle is
        # what lets the transposer's stores spread over all banks.
        e4m3_p: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8)
        p_s = gl.allocate_shared_memory(gl.float8e4nv, [HEADS, BLOCK_N], e4m3_p)
        v_ring = gl.allocate_shared_memory(gl.float8e4nv, [V_STAGES, C, 2 * BLOCK_N], e4m3_128)
    else:
        p_s = gl.allocate_shared_memory(gl.float16, [HEADS, BLOCK_N], f16_128)
        v_ring = gl.allocate_shared_memory(gl.float16, [V_STAGES, V_ROWS, C], f16_128)
    fence_async_shared()

    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(s), count=32 * LOADER_WARPS)  # every loader lane's copies
        # The converter and the attention's QK, or (16 bits, V from registers) the attention's
        # PV alone.
        mbarrier.init(kv_empty.index(s), count=1 if SIXTEEN or PV_REGS else 2)
    for t in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(t), count=1)
        mbarrier.init(v_empty.index(t), count=1)

    # NOTE: a 16-bit pool, or V read into registers, has no converter partition, so each form
    # lists its partitions.
    if SIXTEEN or PV_REGS:
        gl.warp_specialize(
            [
                (
                    _attend,
                    (
                        q_base, stride_qh, qk_scale, k_scale_ptr, q_s, q_pe_s, p_s, lat_ring,
                        pe_ring, v_ring, kv_ready, kv_empty, v_ready, v_empty, mid_o_ptr,
                        mid_lse_ptr, b, split, hg, start, end, num_heads,
                        stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                        out_ptr, counter_ptr, stride_ob, stride_oh, num_splits,
                        MERGE_CHUNKS, MERGE_S_PAD, USE_PDL, PV_REGS, m_s,
                    ),
                ),
                (
                    _loader,
                    (
                        kv_ptr, table_row, start, end, stride_kv, lat_ring, pe_ring, kv_ready,
                        kv_empty, PAGE_SIZE, SLOT_TABLE, USE_PDL, IDS_AHEAD, LOADER_WARPS,
                    ),
                ),
            ],
            [LOADER_WARPS],
            [LOADER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (
                    _attend,
                    (
                        q_base, stride_qh, qk_scale, k_scale_ptr, q_s, q_pe_s, p_s, lat_ring,
                        pe_ring, v_ring, kv_ready, kv_empty, v_ready, v_empty, mid_o_ptr,
                        mid_lse_ptr, b, split, hg, start, end, num_heads,
                        stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                        out_ptr, counter_ptr, stride_ob, stride_oh, num_splits,
                        MERGE_CHUNKS, MERGE_S_PAD, USE_PDL, PV_REGS, m_s,
                    ),
                ),
                (
                    _converter,
                    (start, end, lat_ring, v_ring, kv_ready, kv_empty, v_ready, v_empty),
                ),
                (
                    _loader,
                    (
                        kv_ptr, table_row, start, end, stride_kv, lat_ring, pe_ring, kv_ready,
                        kv_empty, PAGE_SIZE, SLOT_TABLE, USE_PDL, IDS_AHEAD, LOADER_WARPS,
                    ),
                ),
            ],
            [CONVERTER_WARPS, LOADER_WARPS],
            [CONVERTER_REGS, LOADER_REGS],
        )  # fmt: skip


_MERGE_COUNTERS: dict[torch.device, torch.Tensor] = {}


def merge_shape(num_splits: int, width: int) -> tuple[int, int]:
    """`_merge_here`'s CHUNKS (the programs that merge, each width // CHUNKS columns: a power
    of two, at most one a split and at least 8 columns each) and S_PAD (the splits, padded to
    a power of two)."""
    s_pad = triton.next_power_of_2(num_splits)
    return min(s_pad if s_pad == num_splits else s_pad // 2, width // 8), s_pad


def merge_counters(device: torch.device) -> torch.Tensor | None:
    """The in-kernel merge's counters on `device` (`_merge_here`): one int32 an SM, as a grid
    that fits the SMs has no more (request, head group) pairs than that; zeroed once, and each
    launch leaves them at zero. None while a CUDA graph is being captured before any eager call
    made them (their zeroing would be the graph's): the caller merges apart then. Launches on
    one device share them, so they must not overlap in time: the engine keeps its GPU work in
    one stream order (`engine.executor.device_lock`)."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    counters = _MERGE_COUNTERS.get(device)
    if counters is None and not torch.cuda.is_current_stream_capturing():
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        counters = _MERGE_COUNTERS[device] = torch.zeros(sms, dtype=torch.int32, device=device)
    return counters


def fits(device: torch.device, kv_lora_rank: int, rope_dim: int, page_size: int) -> bool:
    """Whether this kernel serves: a Hopper GPU (wgmma; Gluon compiles, never interprets), a
    latent of 256 or 512 (two 64-token e4m3 tiles and two fp16 ones in shared memory), a RoPE
    part of 32 or 64, and tiles that stay inside a page."""
    if is_interpreter() or device.type != "cuda":
        return False
    hopper = torch.cuda.get_device_capability(device) == (9, 0)
    pages_ok = page_size == 1 or page_size % BLOCK_N.value == 0
    return hopper and kv_lora_rank in (256, 512) and rope_dim in (32, 64) and pages_ok


def launch_stage1(
    q: torch.Tensor,
    kv: torch.Tensor,
    table: torch.Tensor,
    row_idx: torch.Tensor | None,
    seq_lens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    qk_scale: float,
    k_scale: torch.Tensor | None,
    page_size: int,
    stages: int,
    v_stages: int,
    v_rows: int,
    q_residual: bool,
    heads: int = BLOCK_H.value,
    pv_e4m3: bool = False,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    pv_regs: bool = False,
    ids_ahead: int = 1,
    loader_warps: int = 1,
) -> None:
    """Stage 1 over an e4m3 pool kv [num_slots, C + R] (with its k_scale) or a 16-bit one (no
    scale; `stages` >= 2 ring slots, no converter: v_stages, v_rows, q_residual and pv_e4m3
    unused): writes mid_o [B, H, S, C] (or the output, S == 1) and mid_lse [B, H, S] as
    `mla_decode._mla_decode_stage1` does. `pv_e4m3`: PV as an e4m3 wgmma over a transposed
    e4m3 V (v_stages slots of a whole tile). With `out` [B, H, C] and `counters`
    (`merge_counters`) the splits are merged inside the kernel into `out` (`_merge_here`; the
    caller makes sure the grid fits the SMs). `pv_regs` (e4m3, 16 heads): PV with V^T read into
    the attention group's registers, no converter and no V ring (v_stages, v_rows unused); with
    `pv_e4m3` those registers feed e4m3 wgmmas (P in e4m3).
    `ids_ahead` 2 (page size 1): the loader reads slot ids two tiles ahead instead of one.
    `loader_warps` (1, 2 or 4; more than one with ids one tile ahead): the loader's warps."""
    batch, num_heads, head_dim = q.shape
    c = mid_o.shape[-1]
    if kv.dtype != torch.float8_e4m3fn:
        assert kv.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype, (
            f"the Gluon kernel takes an fp8, bf16 or fp16 cache and q in its dtype: {kv.dtype}"
        )
        # NOTE: 3 slots of a 512 latent (236 KB) do not fit beside q.
        most = 2 if c == 512 else 3
        assert heads == BLOCK_H.value and 2 <= stages <= most, (
            f"a 16-bit cache takes 16 heads a program and 2-{most} ring slots here"
        )
        k_scale, v_stages, v_rows, q_residual, pv_e4m3 = mid_lse, 1, BLOCK_N.value, False, False
        pv_regs = False
    assert k_scale is not None, "an e4m3 cache needs its k_scale"
    assert ids_ahead in (1, 2), f"slot ids are read 1 or 2 tiles ahead, not {ids_ahead}"
    assert loader_warps in (1, 2, 4), f"the loader takes 1, 2 or 4 warps, not {loader_warps}"
    if page_size != 1:
        ids_ahead = 1  # (two ahead is a page-1 loader's)
    assert loader_warps == 1 or ids_ahead == 1, "ids two tiles ahead are one loader warp's"
    assert not pv_e4m3 or v_rows == BLOCK_N.value, "e4m3 PV takes V a whole tile a slot"
    if pv_regs:
        # NOTE: the ring's slots, q and P; 5 slots of a 512 latent take 200 KB.
        most = 5 if c == 512 else 8
        assert heads == BLOCK_H.value and 2 <= stages <= most, (
            f"V from registers takes 16 heads a program and 2-{most} ring slots"
        )
        v_stages, v_rows = 1, BLOCK_N.value
    num_splits = mid_lse.shape[2]
    grid = (triton.cdiv(num_heads, heads), num_splits, batch)
    merge_chunks, merge_s_pad = 0, 1  # (no merge inside)
    if out is not None:
        assert counters is not None and num_splits > 1, "an in-kernel merge needs counters, splits"
        assert counters.numel() >= grid[0] * batch and counters.dtype == torch.int32
        merge_chunks, merge_s_pad = merge_shape(num_splits, c)
    else:
        out, counters = mid_lse, seq_lens
    launch(
        mla_decode_fp8_ws_kernel, grid,
        q, kv, table, row_idx if row_idx is not None else seq_lens, seq_lens, mid_o, mid_lse,
        qk_scale, k_scale, q.stride(0), q.stride(1), kv.stride(0), table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        num_heads, num_splits, out, counters, out.stride(0), out.stride(1), C=c, R=head_dim - c,
        PAGE_SIZE=page_size, SLOT_TABLE=row_idx is not None, HAS_ROW_IDX=row_idx is not None,
        STAGES=stages, V_STAGES=v_stages, V_ROWS=v_rows, Q_RESIDUAL=q_residual, HEADS=heads,
        PV_E4M3=pv_e4m3, MERGE_CHUNKS=merge_chunks, MERGE_S_PAD=merge_s_pad, num_warps=4,
        PV_REGS=pv_regs, IDS_AHEAD=ids_ahead, LOADER_WARPS=loader_warps, pdl=True,
    )  # fmt: skip
