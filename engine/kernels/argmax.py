"""Greedy sampling's arg-max over each row of the logits, in one launch.

`argmax_rows(x)` equals `torch.argmax(x, dim=-1)` for x [B, V]: the first index of the row's
maximum, a NaN counting as the largest value (the first NaN wins). One program reads one row
in BLOCK-wide slices, each lane keeping the largest value it has seen and where (a strictly
larger value replaces it, so a lane keeps its first maximum); the row's answer is the lowest
index among the lanes that hold the row's maximum. A decode step's greedy draw was five torch
kernels (the chunk maxima, their arg-max, a gather and the index arithmetic), about 16 us at
one row of 102,400 on the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import launch
from engine.kernels.utils import next_power_of_2

MAX_BLOCK = 8192  # elements of a row one program reads at a time


@triton.jit
def _argmax_rows_kernel(x_ptr, out_ptr, width, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    base = x_ptr + row * stride_x
    big = width  # past every real index
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = offs  # an all -inf row answers 0, as torch does
    first_nan = tl.full([BLOCK], 0, dtype=tl.int32) + big
    for start in range(0, width, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < width, other=float("-inf")).to(tl.float32)
        first_nan = tl.minimum(first_nan, tl.where(x != x, idx, big))
        better = x > best  # False for NaN, and for a later equal value
        best = tl.where(better, x, best)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best, 0)
    first_top = tl.min(tl.where(best == top, best_idx, big), 0)
    nan_at = tl.min(first_nan, 0)
    tl.store(out_ptr + row, tl.where(nan_at < big, nan_at, first_top).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] (any float dtype; rows contiguous) -> [B] int64, torch.argmax(x, dim=-1)."""
    rows, width = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    assert width > 0, "argmax of an empty row"
    if x.stride(1) != 1:
        x = x.contiguous()
    block = min(MAX_BLOCK, next_power_of_2(width))
    launch(
        _argmax_rows_kernel, (rows,), x, out, width, x.stride(0),
        BLOCK=block, num_warps=16 if block >= 4096 else 4,
    )  # fmt: skip
    return out
