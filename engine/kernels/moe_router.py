"""The MoE router in one kernel: gate logits -> scores -> (grouped) top-k -> weights.

DeepSeek's two routings (what `engine.layers.moe.select_experts_native` computes):
- V2 (`scoring="softmax"`): softmax scores; with groups (V2's group_limited_greedy) a group
  ranks by its best score and the experts outside the `topk_group` best groups score 0; the
  top-k experts by score, weighted by their scores.
- V3 (`scoring="sigmoid"`): sigmoid scores; the choice adds `correction_bias` (the weights do
  not), a group ranks by the sum of its two best biased scores and the experts outside the best
  groups are out (-inf); the top-k experts by biased score, weighted by their plain scores.
Then, with `renormalize`, the k weights are divided by their sum (+1e-20), and all are multiplied
by `scale` (the routed scaling factor; the caller passes 1.0 where the model does not scale).

One program routes BLOCK_T tokens over all experts (BLOCK_E >= E columns). The gate GEMM (fp32
accumulation, as the reference's float32 F.linear) is folded into the program when the gate
weight is small (V2-Lite: 64 x 2048) and the tokens many (prefill); otherwise it gets its own
kernel over (token, expert, H-split) tiles first, so that one program does not stream the whole
weight alone (at one token that took 15 us a layer), and the router sums the partial logits in a
fixed order. No top-k sort
and no host sync: the top-k is k rounds of arg-max over the row (ties go to the lower id).
Returns float32 weights and int32 ids [T, k], the fused MoE kernel's inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.launch import launch
from engine.kernels.norm import rms_inv, rms_scale_row
from engine.kernels.utils import (
    INTERPRET_UPCAST,
    cdiv,
    dot,
    line_elements,
    next_power_of_2,
    pdl_wait,
    prefetch_rows_l2,
)

# Gate weights up to this size are streamed by the router program itself when there are enough
# tokens to give many programs; otherwise the gate GEMM runs first over (token, expert, H-split)
# tiles and the router sums the splits' partial logits.
FUSE_GATE_MAX_BYTES = 512 * 1024
FUSE_GATE_MIN_TOKENS = 1024
# Tokens up to which `norm_gate_logits` serves (a decode step's few rows: each token's programs
# read the gate slices again, from L2 after the first; timed at one token on the H200).
NORM_GATE_MAX_TOKENS = 4
GATE_BLOCK_T, GATE_BLOCK_E, GATE_BLOCK_H = 16, 16, 128


class RouterOutput(NamedTuple):
    topk_weights: torch.Tensor  # [T, k] float32
    topk_ids: torch.Tensor  # [T, k] int32


@triton.jit
def _gate_tile(x_ptr, w_ptr, offs_t, mask_t, offs_e, mask_e, H, stride_x, stride_w,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
               UPCAST: tl.constexpr):  # fmt: skip
    """logits [BLOCK_T, BLOCK_E] fp32 = x[offs_t] @ w[offs_e]^T, zero outside the masks."""
    offs_h = tl.arange(0, BLOCK_H)
    x_ptrs = x_ptr + offs_t.to(tl.int64)[:, None] * stride_x + offs_h[None, :]
    w_ptrs = w_ptr + offs_e.to(tl.int64)[None, :] * stride_w + offs_h[:, None]
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        mask_h = offs_h < H - h0
        a = tl.load(x_ptrs, mask=mask_t[:, None] & mask_h[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mask_h[:, None] & mask_e[None, :], other=0.0)  # [BH, BE]
        if a.dtype != b.dtype:  # e.g. bf16 activations and an fp32 weight: multiply in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += dot(a, b, UPCAST)
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
    return acc


@triton.jit(do_not_specialize=["T", "stride_s"])  # batch sizes: see launch.py
def _gate_logits_kernel(
    x_ptr, w_ptr, logits_ptr,  # [T, H], [E, H], [S, T, E] fp32 (S: splits of H)
    T, E, H, h_split, stride_x, stride_w, stride_l, stride_s,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST: tl.constexpr,
    LINE: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (t, e, s): the logits of a token tile and an expert tile over split s of H.
    Under PDL it first prefetches its expert rows' slice of H into L2."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    h0 = tl.program_id(2) * h_split
    mask_t, mask_e = offs_t < T, offs_e < E
    if USE_PDL:
        if tl.program_id(0) == 0:  # one token tile fetches the weight for all
            rows = w_ptr + offs_e.to(tl.int64) * stride_w + h0
            prefetch_rows_l2(rows, mask_e, tl.minimum(h_split, H - h0), LINE, 16)
    pdl_wait(USE_PDL)
    acc = _gate_tile(
        x_ptr + h0, w_ptr + h0, offs_t, mask_t, offs_e, mask_e, tl.minimum(h_split, H - h0),
        stride_x, stride_w, BLOCK_T, BLOCK_E, BLOCK_H, UPCAST,
    )  # fmt: skip
    l_ptrs = logits_ptr + tl.program_id(2).to(tl.int64) * stride_s
    l_ptrs += offs_t.to(tl.int64)[:, None] * stride_l + offs_e[None, :]
    tl.store(l_ptrs, acc, mask=mask_t[:, None] & mask_e[None, :])


@triton.jit(do_not_specialize=["stride_s"])
def _norm_gate_kernel(
    x_ptr, res_ptr, norm_w_ptr, out_ptr, res_out_ptr,  # [T, H] rows; norm weight [H]
    w_ptr, logits_ptr,  # gate [E, H]; partial logits [S, T, E] fp32 (S: splits of H)
    H, E, h_split, eps,
    stride_x, stride_res, stride_out, stride_res_out, stride_w, stride_l, stride_s,
    BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_HS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (t, e, s): token t's fused add + RMSNorm (as `engine.kernels.norm` computes it;
    the e = 0 programs store split s's slice of its two outputs) and the gate logits of expert
    tile e over split s of H, from the normed row. The gate slice is loaded before the wait."""
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    offs_hs = split * h_split + tl.arange(0, BLOCK_HS)
    mask_e = offs_e < E
    mask_hs = (tl.arange(0, BLOCK_HS) < h_split) & (offs_hs < H)
    w_ptrs = w_ptr + offs_e.to(tl.int64)[:, None] * stride_w + offs_hs[None, :]
    w = tl.load(w_ptrs, mask=mask_e[:, None] & mask_hs[None, :], other=0.0)
    pdl_wait(USE_PDL)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x_row, res_row = x_ptr + t * stride_x, res_ptr + t * stride_res
    res_dtype = res_out_ptr.dtype.element_ty
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    r = tl.load(res_row + offs, mask=mask, other=0.0)
    row = (x.to(tl.float32) + r.to(tl.float32)).to(res_dtype).to(tl.float32)
    inv_rms = rms_inv(row, H, eps)
    # This split's slice again (from L1): a register row cannot be sliced.
    xs = tl.load(x_row + offs_hs, mask=mask_hs, other=0.0)
    rs = tl.load(res_row + offs_hs, mask=mask_hs, other=0.0)
    ss = (xs.to(tl.float32) + rs.to(tl.float32)).to(res_dtype)
    normed = rms_scale_row(ss.to(tl.float32), inv_rms, norm_w_ptr, offs_hs, mask_hs, x.dtype)
    normed = normed.to(out_ptr.dtype.element_ty)
    if tl.program_id(1) == 0:
        tl.store(out_ptr + t * stride_out + offs_hs, normed, mask=mask_hs)
        tl.store(res_out_ptr + t * stride_res_out + offs_hs, ss, mask=mask_hs)
    logits = tl.sum(normed.to(tl.float32)[None, :] * w.to(tl.float32), 1)
    l_ptrs = logits_ptr + split.to(tl.int64) * stride_s + t * stride_l + offs_e
    tl.store(l_ptrs, logits, mask=mask_e)


@triton.jit
def _argmax(vals, offs, BIG: tl.constexpr):
    """Per row of vals [M, N]: the max and the lowest column index holding it."""
    m = tl.max(vals, 1)
    idx = tl.min(tl.where(vals == m[:, None], offs[None, :], BIG), 1)
    return m, idx


@triton.jit
def _split_logits(l_ptrs, split, stride_s, mask, num_splits):
    """Split `split`'s partial logits [BLOCK_T, BLOCK_E] (zeros past the last split)."""
    in_range = (tl.zeros_like(mask.to(tl.int32)) + split) < num_splits
    return tl.load(l_ptrs + split * stride_s, mask=mask & in_range, other=0.0)


@triton.jit(do_not_specialize=["T", "stride_s", "num_splits"])
def _moe_router_kernel(
    x_ptr,  # [T, H] (FUSE_GATE) or fp32 partial logits [num_splits, T, E], summed here
    w_ptr,  # [E, H] gate weight (FUSE_GATE)
    bias_ptr,  # [E] fp32 correction bias (HAS_BIAS)
    topk_w_ptr,  # [T, TOP_K + NUM_SHARED] fp32
    topk_ids_ptr,  # [T, TOP_K + NUM_SHARED] int32
    T, E, H, stride_x, stride_w, stride_s, group_size, scale,
    num_splits,  # a runtime bound: the split count follows the batch size (gate_logit_splits)
    TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr,
    NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    FUSE_GATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    mask_t, mask_e = offs_t < T, offs_e < E
    pdl_wait(USE_PDL)
    if FUSE_GATE:
        logits = _gate_tile(
            x_ptr, w_ptr, offs_t, mask_t, offs_e, mask_e, H, stride_x, stride_w,
            BLOCK_T, BLOCK_E, BLOCK_H, UPCAST,
        )  # fmt: skip
    else:
        l_ptrs = x_ptr + offs_t.to(tl.int64)[:, None] * stride_x + offs_e[None, :]
        mask_l = mask_t[:, None] & mask_e[None, :]
        logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        # In split order, so the sum does not vary by run; four loads issued before the first
        # is added (one load at a time waited on L2 for each of 16 splits: about 4 us).
        for s0 in range(0, num_splits, 4):
            p0 = _split_logits(l_ptrs, s0, stride_s, mask_l, num_splits)
            p1 = _split_logits(l_ptrs, s0 + 1, stride_s, mask_l, num_splits)
            p2 = _split_logits(l_ptrs, s0 + 2, stride_s, mask_l, num_splits)
            p3 = _split_logits(l_ptrs, s0 + 3, stride_s, mask_l, num_splits)
            logits += p0
            logits += p1
            logits += p2
            logits += p3
    neg_inf = float("-inf")
    valid = mask_e[None, :] & (offs_t[:, None] >= 0)  # [BLOCK_T, BLOCK_E]
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)[None, :]
    else:
        z = tl.where(valid, logits, neg_inf)
        p = tl.exp(z - tl.max(z, 1)[:, None])
        scores = p / tl.sum(p, 1)[:, None]
        choice = scores
    choice = tl.where(valid, choice, neg_inf)

    if NUM_GROUPS > 1:
        # Rank the groups (V2: best score; V3: sum of the two best biased scores), keep the
        # TOPK_GROUP best, and take the experts of the other groups out of the choice.
        group_of = offs_e // group_size
        offs_g = tl.arange(0, BLOCK_G)
        group_scores = tl.full([BLOCK_T, BLOCK_G], neg_inf, dtype=tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            vals = tl.where((group_of == g)[None, :], choice, neg_inf)
            best, best_idx = _argmax(vals, offs_e, BLOCK_E)
            if SIGMOID:
                second = tl.max(tl.where(offs_e[None, :] == best_idx[:, None], neg_inf, vals), 1)
                best = best + second
            group_scores = tl.where(offs_g[None, :] == g, best[:, None], group_scores)
        keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, g_idx = _argmax(group_scores, offs_g, BLOCK_G)
            group_scores = tl.where(offs_g[None, :] == g_idx[:, None], neg_inf, group_scores)
            keep = keep | (group_of[None, :] == g_idx[:, None])
        if SIGMOID:
            choice = tl.where(keep, choice, neg_inf)
        else:
            choice = tl.where(keep | ~valid, choice, 0.0)  # V2 zeroes the scores (masked_fill)

    offs_k = tl.arange(0, BLOCK_K)
    topk_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    topk_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        w, idx = _argmax(choice, offs_e, BLOCK_E)
        picked = offs_e[None, :] == idx[:, None]
        if SIGMOID:  # V3 weighs by the score without the bias; V2 by the (masked) score itself
            w = tl.sum(tl.where(picked, scores, 0.0), 1)
        topk_w = tl.where(offs_k[None, :] == k, w[:, None], topk_w)
        topk_ids = tl.where(offs_k[None, :] == k, idx[:, None], topk_ids)
        choice = tl.where(picked, neg_inf, choice)
    if RENORMALIZE:
        topk_w = topk_w / (tl.sum(topk_w, 1)[:, None] + 1e-20)
    topk_w = topk_w * scale
    if NUM_SHARED > 0:  # the shared experts' slots E.., weight 1
        shared = (offs_k >= TOP_K)[None, :]
        topk_w = tl.where(shared, 1.0, topk_w)
        topk_ids = tl.where(shared, E + offs_k[None, :] - TOP_K, topk_ids)
    out = offs_t.to(tl.int64)[:, None] * (TOP_K + NUM_SHARED) + offs_k[None, :]
    mask_out = mask_t[:, None] & (offs_k[None, :] < TOP_K + NUM_SHARED)
    tl.store(topk_w_ptr + out, topk_w, mask=mask_out)
    tl.store(topk_ids_ptr + out, topk_ids, mask=mask_out)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def gate_logit_splits(num_tokens: int, num_experts: int, hidden: int) -> int:
    """Splits of H for the gate GEMM: enough programs to stream the gate weight from many SMs
    when there are few tokens (a decode step), one split when the token tiles fill the GPU."""
    tiles = cdiv(num_tokens, GATE_BLOCK_T) * cdiv(num_experts, GATE_BLOCK_E)
    return max(1, min(16, hidden // 256, 128 // tiles))


def _gate_split(hidden: int, splits: int) -> tuple[int, int]:
    """(h_split, splits used): each of `splits` slices of H rounded up to whole GATE_BLOCK_H
    tiles, and how many slices that leaves nonempty."""
    h_split = cdiv(cdiv(hidden, splits), GATE_BLOCK_H) * GATE_BLOCK_H
    return h_split, cdiv(hidden, h_split)


def gate_logits(x: torch.Tensor, weight: torch.Tensor, splits: int = 1) -> torch.Tensor:
    """x [T, H] @ weight [E, H]^T -> [splits, T, E] float32 partial sums over `splits` slices
    of H (fp32 accumulation, 16-bit tensor cores when x and weight share a 16-bit dtype)."""
    x, weight = _rows(x), _rows(weight)
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    logits = torch.empty(splits, num_tokens, num_experts, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return logits
    h_split, splits_used = _gate_split(hidden, splits)
    if splits_used < splits:  # rounding left the last splits empty: they hold zeros
        logits[splits_used:].zero_()
    grid = (
        cdiv(num_tokens, GATE_BLOCK_T),
        cdiv(num_experts, GATE_BLOCK_E),
        splits_used,
    )
    launch(
        _gate_logits_kernel, grid,
        x, weight, logits, num_tokens, num_experts, hidden, h_split, x.stride(0),
        weight.stride(0), logits.stride(1), logits.stride(0), BLOCK_T=GATE_BLOCK_T,
        BLOCK_E=GATE_BLOCK_E, BLOCK_H=GATE_BLOCK_H, UPCAST=INTERPRET_UPCAST,
        LINE=line_elements(weight), num_warps=4, pdl=True,
    )  # fmt: skip
    return logits


def norm_gate_logits(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE layer's fused add + RMSNorm and its gate logits in one launch, for a decode
    step's few tokens (at most NORM_GATE_MAX_TOKENS): x, residual [T, H] -> (norm(x +
    residual), x + residual, partial logits [S, T, E] fp32 for `moe_router(gate_partials=)`).
    The norm's outputs are those of `engine.kernels.norm.fused_add_rms_norm`."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    assert num_tokens <= NORM_GATE_MAX_TOKENS and residual.shape == x.shape
    assert x.stride(1) == 1 and residual.stride(1) == 1 and gate_weight.stride(1) == 1
    out = torch.empty_like(x, dtype=torch.promote_types(norm_weight.dtype, x.dtype))
    res_out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, residual.dtype))
    wanted = gate_logit_splits(max(num_tokens, 1), num_experts, hidden)
    h_split, splits = _gate_split(hidden, wanted)
    logits = torch.empty(splits, num_tokens, num_experts, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out, res_out, logits
    block_h = next_power_of_2(hidden)
    launch(
        _norm_gate_kernel, (num_tokens, cdiv(num_experts, GATE_BLOCK_E), splits),
        x, residual, norm_weight, out, res_out, gate_weight, logits, hidden, num_experts,
        h_split, eps, x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0),
        gate_weight.stride(0), logits.stride(1), logits.stride(0),
        BLOCK_H=block_h, BLOCK_E=GATE_BLOCK_E, BLOCK_HS=next_power_of_2(h_split),
        num_warps=min(max(block_h // 256, 1), 8), pdl=True,
    )  # fmt: skip
    return out, res_out, logits


def moe_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_group: int = 1,
    renormalize: bool = False,
    scale: float = 1.0,
    num_shared: int = 0,
    fuse_gate: bool | None = None,
    gate_partials: torch.Tensor | None = None,
) -> RouterOutput:
    """x [T, H]; weight [E, H] (the gate); correction_bias [E] fp32 (sigmoid scoring only).

    `num_shared` > 0 appends that many columns naming experts E, E+1, ... with weight 1 (the
    shared experts' slots in the fused MoE). `fuse_gate` (None: by the weight's size) computes
    the gate logits inside the router program. `gate_partials` [S, T, E]: the gate logits in S
    partial sums, computed already (`norm_gate_logits`).
    """
    assert scoring in ("softmax", "sigmoid"), scoring
    assert correction_bias is None or scoring == "sigmoid"
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    assert num_experts % num_groups == 0 and top_k <= num_experts
    width = top_k + num_shared
    topk_weights = torch.empty(num_tokens, width, dtype=torch.float32, device=x.device)
    topk_ids = torch.empty(num_tokens, width, dtype=torch.int32, device=x.device)
    if num_tokens == 0:
        return RouterOutput(topk_weights, topk_ids)
    if gate_partials is not None:
        assert gate_partials.shape[1:] == (num_tokens, num_experts), gate_partials.shape
        assert gate_partials.is_contiguous()
        fuse_gate, src, splits = False, gate_partials, gate_partials.shape[0]
    else:
        if fuse_gate is None:
            small = weight.numel() * weight.element_size() <= FUSE_GATE_MAX_BYTES
            fuse_gate = small and num_tokens >= FUSE_GATE_MIN_TOKENS
        if fuse_gate:
            src, weight, splits = _rows(x), _rows(weight), 1
        else:
            splits = gate_logit_splits(num_tokens, num_experts, hidden)
            src = gate_logits(x, weight, splits)
    block_e = max(16, next_power_of_2(num_experts))
    block_t = 16
    launch(
        _moe_router_kernel, (cdiv(num_tokens, block_t),),
        src, weight, correction_bias if correction_bias is not None else topk_weights,
        topk_weights, topk_ids,
        num_tokens, num_experts, hidden, src.stride(-2), weight.stride(0),
        src.stride(0) if splits > 1 else 0, num_experts // num_groups, float(scale), splits,
        TOP_K=top_k, NUM_SHARED=num_shared, NUM_GROUPS=num_groups,
        TOPK_GROUP=topk_group,
        SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
        RENORMALIZE=renormalize, FUSE_GATE=fuse_gate, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_H=64 if block_e <= 64 else 32, BLOCK_G=max(2, next_power_of_2(num_groups)),
        BLOCK_K=max(2, next_power_of_2(width)), UPCAST=INTERPRET_UPCAST,
        num_warps=4 if block_e <= 128 else 8, pdl=True,
    )  # fmt: skip
    return RouterOutput(topk_weights, topk_ids)
