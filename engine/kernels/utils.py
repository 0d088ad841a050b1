"""Small helpers shared by the Triton kernels."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from engine.kernels.launch import is_interpreter, launch

try:  # the grid-dependency intrinsics of programmatic dependent launch (Triton 3.5+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: launch.pdl_active() is False there

    @triton.jit
    def gdc_wait() -> None:
        pass

    @triton.jit
    def gdc_launch_dependents() -> None:
        pass


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code (triton.cdiv is a constexpr function there: a few us a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0), as triton.next_power_of_2, in plain Python."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the current GPU (132 on an H200; 132 assumed on CPU)."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).multi_processor_count)
    return 132


@functools.cache
def has_fp8_cvt(device: torch.device) -> bool:
    """Whether the GPU has PTX's e4m3 -> f16 conversion (`cvt.rn.f16x2.e4m3x2`, sm_89+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# NOTE: Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly (it multiplies the raw
# 16-bit patterns), so on CPU the kernels upcast dot operands to fp32 first. On a GPU the flag
# is False and the dot runs on the tensor cores in the operands' own dtype.
INTERPRET_UPCAST = is_interpreter()


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation; upcasts the operands when UPCAST (interpreter only).

    fp32 operands are multiplied in full precision (not TF32): fp32 models are what the
    correctness tests compare against transformers.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


# ---- programmatic dependent launch (see engine.kernels.launch) ---------------------------------


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """A PDL kernel's wait: from here on the previous launch has finished and its writes are
    visible; then the next launch may start (its programs run up to their own wait)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask the L2 cache for the lines holding `ptrs` where `mask` (no registers are filled):
    what a kernel streams later, fetched before its PDL wait while the previous kernel runs."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_span_l2(base_ptr, numel, pid, num_programs, LINE: tl.constexpr,
                     BLOCK_L: tl.constexpr):  # fmt: skip
    """Program `pid` of `num_programs` prefetches its share of the 128-byte lines of the
    contiguous base_ptr[0:numel] (LINE elements a line), so the grid fetches all of it."""
    lines = tl.cdiv(numel, LINE)
    per = tl.cdiv(lines, num_programs)
    offs = tl.arange(0, BLOCK_L)
    for i in range(0, per, BLOCK_L):
        line = pid * per + i + offs
        prefetch_l2(base_ptr + line.to(tl.int64) * LINE, (i + offs < per) & (line < lines))


@triton.jit
def prefetch_rows_l2(row_ptrs, mask_rows, K, LINE: tl.constexpr, BLOCK_L: tl.constexpr):
    """Prefetch K contiguous elements from each row start in row_ptrs [R] (where mask_rows)."""
    offs = tl.arange(0, BLOCK_L) * LINE
    for k0 in range(0, K, BLOCK_L * LINE):
        cols = k0 + offs
        prefetch_l2(row_ptrs[:, None] + cols[None, :], mask_rows[:, None] & (cols < K)[None, :])


@triton.jit
def load_head_slice(w_ptr, h, stride_h, stride_k, stride_n, offs_k, offs_n, mask_n):
    """Columns offs_n (zero past mask_n) of head h's [K, N] matrix in a per-head weight
    [H, K, N] (any strides): what a (slice, head) program of a one-row product loads, before
    its PDL wait."""
    ptrs = w_ptr + h * stride_h + offs_k[:, None] * stride_k + offs_n[None, :] * stride_n
    return tl.load(ptrs, mask=mask_n[None, :], other=0.0)


@triton.jit
def row_product(x, w):
    """One row x [K] @ w [K, N] -> [N] fp32, on the CUDA cores (no padded MMA tile)."""
    return tl.sum(x.to(tl.float32)[:, None] * w.to(tl.float32), 0)


def line_elements(t: torch.Tensor) -> int:
    """Elements of t's dtype in a 128-byte cache line (prefetch_* helpers' LINE)."""
    return max(1, 128 // t.element_size())


def contiguous_span(t: torch.Tensor) -> int:
    """numel when t covers one contiguous range from its data pointer (in any dim order, e.g. a
    transposed view), else 0: what `prefetch_span_l2` may fetch of it."""
    if t.is_contiguous() or t.transpose(-1, -2).is_contiguous():
        return t.numel()
    return 0


# ---- pieces shared by the split-KV decode kernels (MLA and GQA) and the extend kernel ----------


@triton.jit
def online_softmax_step(qk, m_i, l_i, AXIS: tl.constexpr = 1):
    """One tile of the streaming softmax, in log2 units: scores qk [M, N] (-inf where masked)
    and the running max m_i and sum l_i [M] -> the tile's probabilities p, the factor alpha that
    rescales what was accumulated so far, and the new running max and sum. With AXIS 0 the
    scores come transposed, [N, M], and so does p."""
    m_new = tl.maximum(m_i, tl.max(qk, AXIS))
    alpha = tl.exp2(m_i - m_new)
    if AXIS == 1:
        p = tl.exp2(qk - m_new[:, None])
    else:
        p = tl.exp2(qk - m_new[None, :])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, AXIS)


@triton.jit
def split_bounds(seq_lens_ptr, row_idx_ptr, b, split, num_splits, HAS_ROW_IDX, BLOCK_N):
    """Table row and token range [start, end) of one split of request b."""
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    if HAS_ROW_IDX:
        row = tl.load(row_idx_ptr + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    # Split boundaries are multiples of BLOCK_N so that paged tiles stay inside one page.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    return row, start, end


@triton.jit
def store_split(
    mid_o_ptr, mid_lse_ptr, acc, m_i, l_i, out_scale, b, split, offs_h, mask_h, offs_c, mask_c,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, nonempty,
):  # fmt: skip
    """Write one split's normalized output acc [H, C] (times out_scale) and its log-sum-exp
    (log2 units), for `merge_splits`. `mask_c` masks padded value columns (None: none).

    `mid_o_ptr` may be the final output (one split): the store casts to its dtype.
    """
    mo_ptrs = (
        mid_o_ptr
        + b.to(tl.int64) * stride_mob
        + offs_h[:, None] * stride_moh
        + split * stride_mos
        + offs_c[None, :]
    )
    ml_ptrs = mid_lse_ptr + b.to(tl.int64) * stride_mlb + offs_h * stride_mlh + split
    if nonempty:
        out = acc * (out_scale / l_i)[:, None]
        mask = mask_h[:, None]
        if mask_c is not None:
            mask = mask & mask_c[None, :]
        tl.store(mo_ptrs, out.to(mid_o_ptr.dtype.element_ty), mask=mask)
        tl.store(ml_ptrs, m_i + tl.log2(l_i), mask=mask_h)
    else:
        tl.store(ml_ptrs, tl.full(m_i.shape, float("-inf"), dtype=tl.float32), mask=mask_h)


@triton.jit
def merge_row(mo_base, ml_base, num_splits, stride_mos, offs_c,
              BLOCK_S: tl.constexpr, BLOCK_SA: tl.constexpr):  # fmt: skip
    """One (request, head)'s splits merged: rows mo_base + s * stride_mos (at offs_c) weighted
    by their share exp2(lse_s) of the softmax sum (lse_s at ml_base + s, log2 units; -inf for
    an empty split) -> fp32 row.

    The splits are read BLOCK_S at a time (BLOCK_SA >= num_splits), each chunk's rows in one
    load, and only up to the last nonempty split: a graph's split count is sized for the longest
    context it may replay, so at short contexts most splits are empty."""
    offs_sa = tl.arange(0, BLOCK_SA)
    lse = tl.load(ml_base + offs_sa, mask=offs_sa < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: split 0 always holds at least one token
    denom = tl.sum(tl.exp2(lse - m), 0)
    last = tl.max(tl.where(lse > float("-inf"), offs_sa + 1, 0), 0)
    offs_s = tl.arange(0, BLOCK_S)
    acc = tl.zeros(offs_c.shape, dtype=tl.float32)
    for s0 in range(0, last, BLOCK_S):
        s = s0 + offs_s
        w = tl.exp2(tl.load(ml_base + s, mask=s < last, other=float("-inf")) - m)
        rows = tl.load(mo_base + s[:, None] * stride_mos + offs_c[None, :],
                       mask=(w > 0.0)[:, None], other=0.0)  # fmt: skip
        acc += tl.sum(w[:, None] * rows, 0)
    return acc / denom


@triton.jit
def _merge_splits_kernel(
    mid_o_ptr,  # [B, H, S, C] fp32
    mid_lse_ptr,  # [B, H, S] fp32
    o_ptr,  # [B, H, C]
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    num_splits,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_SA: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """One (head, request, BLOCK_C columns): the splits' outputs weighted by their share of the
    softmax sum."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    pdl_wait(USE_PDL)
    out = merge_row(
        mid_o_ptr + b * stride_mob + h * stride_moh, mid_lse_ptr + b * stride_mlb + h * stride_mlh,
        num_splits, stride_mos, offs_c, BLOCK_S, BLOCK_SA,
    )  # fmt: skip
    o_ptrs = o_ptr + b * stride_ob + h * stride_oh + offs_c
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty))


def merge_column_chunks(rows: int, width: int, sms: int | None = None) -> int:
    """Programs a merged row is cut into, by columns (powers of two, at least 64 columns each),
    so that fewer rows than SMs still fill about one program an SM: at batch 1 the merge of 16
    heads would otherwise be 16 programs, each reading all its splits alone."""
    sms = sms if sms is not None else num_sms()
    chunks = 1
    while width // (chunks * 2) >= 64 and width % (chunks * 2) == 0 and rows * chunks < sms:
        chunks *= 2
    return chunks


def merge_blocks(num_splits: int, width: int) -> tuple[int, int]:
    """`merge_row`'s BLOCK_S (splits a load; about 8K fp32 values) and BLOCK_SA."""
    block_sa = max(2, next_power_of_2(num_splits))
    return min(block_sa, max(1, 8192 // width)), block_sa


def choose_num_kv_splits(
    batch: int,
    num_heads: int,
    max_seq_len: int,
    block_h: int = 16,
    block_n: int = 64,
    sms: int | None = None,
    waves: float = 2.0,
    min_tokens_per_split: int = 256,
) -> int:
    """Split count so that batch x head groups x splits fills about `waves` waves of the SMs.

    Each split keeps at least `min_tokens_per_split` tokens, so short contexts are not cut into
    pieces whose merge costs more than it saves.
    """
    sms = sms if sms is not None else num_sms()
    programs = batch * math.ceil(num_heads / block_h)
    want = int(waves * sms) // max(programs, 1)
    most = max(1, math.ceil(max_seq_len / max(min_tokens_per_split, block_n)))
    return int(max(1, min(want, most, 64)))


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Stage 2: mid_o [B, H, S, Dv] fp32 and mid_lse [B, H, S] (log2) -> out [B, H, Dv].

    A program a (head, request, column chunk): few rows are cut by columns
    (`merge_column_chunks`), 1.3-1.6x the whole MLA decode at batch 1 on an H100 (perf/
    RESULTS.md, run AQ)."""
    batch, num_heads, num_splits, dv = mid_o.shape
    chunks = merge_column_chunks(batch * num_heads, dv)
    block_c = dv // chunks
    block_s, block_sa = merge_blocks(num_splits, block_c)
    launch(
        _merge_splits_kernel, (num_heads, batch, chunks),
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1), num_splits,
        BLOCK_C=block_c, BLOCK_S=block_s, BLOCK_SA=block_sa,
        num_warps=4 if dv >= 256 else 2, pdl=True,
    )  # fmt: skip
