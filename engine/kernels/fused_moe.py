"""Fused MoE: tokens aligned to experts in blocks, one grouped GEMM for gate/up (SiLU-and-mul
fused into its epilogue) and one for down (top-k weight fused), then the top-k sum.

`moe_align_block_size` sorts the (token, k) pairs by expert and pads each expert's run to a
multiple of BLOCK_M, with torch ops only (no host sync, so it can be captured in a CUDA graph).
Each GEMM program takes one BLOCK_M block, which belongs to exactly one expert, and one BLOCK_N
slice of the output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.utils import INTERPRET_UPCAST, dot, is_interpreter


class MoEAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # [max_padded] int32: flat (token * top_k + k) ids; pad = T * top_k
    expert_ids: torch.Tensor  # [max_blocks] int32: the expert of each BLOCK_M block
    num_padded: torch.Tensor  # [1] int32: used length of sorted_ids


class MoEConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_moe_config(num_pairs: int, num_experts: int, elem_bytes: int = 2) -> MoEConfig:
    """Tiles by load: few (token, expert) pairs per expert -> small BLOCK_M (decode).

    The tiles are sized for 16-bit weights; fp32 halves BLOCK_K to stay in shared memory.
    """
    if is_interpreter():
        return MoEConfig(16, 32, 32, 4, 1)
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        cfg = MoEConfig(16, 64, 128, 4, 4)
    elif per_expert <= 64:
        cfg = MoEConfig(32, 64, 128, 4, 4)
    else:
        cfg = MoEConfig(64, 128, 64, 8, 3)
    return cfg._replace(block_k=cfg.block_k * 2 // max(elem_bytes, 2))


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """topk_ids [T, k] -> pairs sorted by expert, each expert's run padded to block_m."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_blocks = triton.cdiv(max_padded, block_m)
    # NOTE: scatter_add rather than bincount, which syncs with the host on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    count_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - count_start[sorted_experts]
    dest = padded_start[sorted_experts] + rank
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=flat.device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32)
    return MoEAlignment(sorted_ids, expert_ids, num_padded)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: hidden [T, H] (A_DIV_TOPK) or activations [T * top_k, I]
    b_ptr,  # [E, N (x2 when GATED), K]: w13 or w2
    c_ptr,  # [T * top_k, N]
    topk_w_ptr,  # [T * top_k] fp32
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N, K, num_pairs, top_k,
    stride_am, stride_be, stride_bn, stride_cm,
    A_DIV_TOPK: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if A_DIV_TOPK:
        a_rows = ids // top_k
    else:
        a_rows = ids
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        acc += dot(a, b, UPCAST)
        if GATED:
            b_up = tl.load(
                b_ptrs + N * stride_bn, mask=mask_k[:, None] & mask_n[None, :], other=0.0
            )
            acc_up += dot(a, b_up, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if MUL_WEIGHT:
        w = tl.load(topk_w_ptr + ids, mask=valid, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def _moe_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    align: MoEAlignment,
    top_k: int,
    n: int,
    a_div_topk: bool,
    gated: bool,
    mul_weight: bool,
    cfg: MoEConfig,
) -> None:
    k = a.shape[1]
    grid = (align.expert_ids.shape[0], triton.cdiv(n, cfg.block_n))
    _moe_gemm_kernel[grid](
        a, b, c, topk_weights, align.sorted_ids, align.expert_ids, align.num_padded,
        n, k, c.shape[0], top_k, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_DIV_TOPK=a_div_topk, GATED=gated, MUL_WEIGHT=mul_weight,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=INTERPRET_UPCAST,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    topk_weights [T, k]; topk_ids [T, k]. Returns [T, H] = sum_k w_k * down(silu(g) * u)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    assert hidden.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    cfg = config or default_moe_config(num_tokens * top_k, num_experts, w13.element_size())
    align = moe_align_block_size(topk_ids, num_experts, cfg.block_m)
    weights = topk_weights.reshape(-1).to(torch.float32)
    act = hidden.new_empty((num_tokens * top_k, inter))
    _moe_gemm(hidden, w13, act, weights, align, top_k, inter, True, True, False, cfg)
    down = hidden.new_empty((num_tokens * top_k, hidden_size))
    _moe_gemm(act, w2, down, weights, align, top_k, hidden_size, False, False, True, cfg)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1)
