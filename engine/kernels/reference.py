"""Plain-PyTorch references of the Triton kernels: what the kernel tests compare against and the
benchmarks' baselines. Not used by the engine at run time.

Each `<kernel>_ref` takes the kernel's arguments (less its tuning knobs) and computes in fp32.
The maths is the engine's torch-native code where that exists, so kernels and CPU path are
checked against one definition: attention is the torch-native backend's causal attention, the
MoE is the per-expert loop of `engine.layers.moe`, FP8 is `engine.kernels.fp8`.
"""

from __future__ import annotations

import torch

from engine.kernels.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8
from engine.kernels.fused_moe import SharedExperts, shared_expert_slots
from engine.layers.activation import silu_and_mul_native
from engine.layers.attention.torch_native import causal_attention as _native_causal_attention
from engine.layers.fp8_bmm import bmm_fp8_native
from engine.layers.moe import append_shared_experts, moe_forward_native, select_experts_native
from engine.layers.norm import fused_add_rms_norm_native, rms_norm_native
from engine.layers.rotary import apply_rope_native, rope_cos_sin

# ---- attention -----------------------------------------------------------------------------


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, sm_scale: float
) -> torch.Tensor:
    """q [n, Hq, D] at positions prefix_len.. over a whole context k [L, Hkv, D], v [L, Hkv, Dv]
    -> [n, Hq, Dv] in fp32: query i sees keys 0..prefix_len + i (a decode: n = 1, prefix L - 1).
    """
    return _native_causal_attention(q.float(), k.float(), v.float(), prefix_len, sm_scale)


def _decode_attention(
    q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], sm_scale: float
) -> torch.Tensor:
    """q [B, H, D]; request b's whole context ks[b] [L_b, Hkv, D], vs[b] [L_b, Hkv, Dv]
    -> [B, H, Dv] fp32: each request's one query sees all of its context."""
    outs = [
        causal_attention(q[b : b + 1], k, v, k.shape[0] - 1, sm_scale)[0]
        for b, (k, v) in enumerate(zip(ks, vs, strict=True))
    ]
    return torch.stack(outs)


def _dequant(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A pool's rows in fp32: FP8 rows times their scale, others as they are."""
    if x.dtype == FP8_DTYPE:
        assert scale is not None, "an fp8 pool needs its scale"
        return dequantize_fp8(x, scale)
    return x.float()


def _context_slots(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor
) -> list[torch.Tensor]:
    """Slot ids of positions 0..lens[b] - 1 of each request, read through req_to_token."""
    return [
        req_to_token[int(row), : int(n)].long()
        for row, n in zip(req_pool_indices, lens, strict=True)
    ]


def mla_attention_ref(
    q: torch.Tensor, kv_rows: list[torch.Tensor], kv_lora_rank: int, sm_scale: float
) -> torch.Tensor:
    """q [B, H, C + R] and one [L_b, C + R] fp32 row block per request -> o [B, H, C] fp32.

    Absorbed MLA is attention with one KV head whose value is the latent part of the key."""
    ks = [rows[:, None] for rows in kv_rows]
    return _decode_attention(q, ks, [k[..., :kv_lora_rank] for k in ks], sm_scale)


def mla_decode_ref(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for `mla_decode` (page size 1 addressing). Returns [B, H, C] in q's dtype."""
    kv = _dequant(kv_buffer[:, 0], k_scale)
    rows = [kv[s] for s in _context_slots(req_to_token, req_pool_indices, seq_lens)]
    return mla_attention_ref(q, rows, kv_lora_rank, sm_scale).to(q.dtype)


def mla_decode_paged_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for `mla_decode_paged`. Returns [B, H, C] in q's dtype."""
    page_size = kv_cache.shape[1]
    kv = _dequant(kv_cache.flatten(0, 1)[:, 0], k_scale)
    rows = []
    for b in range(q.shape[0]):
        pos = torch.arange(int(seq_lens[b]), device=q.device)
        slots = block_table[b, pos // page_size].long() * page_size + pos % page_size
        rows.append(kv[slots])
    return mla_attention_ref(q, rows, kv_lora_rank, sm_scale).to(q.dtype)


def gqa_decode_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for `gqa_decode`. Returns [B, Hq, Dv] in q's dtype."""
    k, v = _dequant(k_buffer, k_scale), _dequant(v_buffer, v_scale)
    slots = _context_slots(req_to_token, req_pool_indices, seq_lens)
    return _decode_attention(q, [k[s] for s in slots], [v[s] for s in slots], sm_scale).to(q.dtype)


def extend_attention_ref(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Reference for `extend_attention`. Returns [T, Hq, Dv] in q's dtype."""
    out = torch.empty(q_extend.shape[:2] + (v_extend.shape[2],), device=q_extend.device)
    prefix_slots = _context_slots(req_to_token, req_pool_indices, prefix_lens)
    for b, slots in enumerate(prefix_slots):
        pre, s0 = len(slots), int(extend_start_loc[b])
        new = slice(s0, s0 + int(seq_lens[b]) - pre)
        k = torch.cat([k_buffer[slots].float(), k_extend[new].float()])  # [L, Hkv, D]
        v = torch.cat([v_buffer[slots].float(), v_extend[new].float()])
        out[new] = causal_attention(q_extend[new], k, v, pre, sm_scale)
    return out.to(q_extend.dtype)


def ragged_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    q_start_loc: torch.Tensor,
    kv_start_loc: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Reference for `ragged_attention`. Returns [T, Hq, Dv] in q's dtype."""
    out = torch.empty(q.shape[:2] + (v.shape[2],), device=q.device)
    for b in range(seq_lens.shape[0]):
        total, pre = int(seq_lens[b]), int(prefix_lens[b])
        q0, kv0 = int(q_start_loc[b]), int(kv_start_loc[b])
        new, rows = slice(q0, q0 + total - pre), slice(kv0, kv0 + total)
        out[new] = causal_attention(q[new], k[rows], v[rows], pre, sm_scale)
    return out.to(q.dtype)


# ---- MoE -----------------------------------------------------------------------------------


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared_output: torch.Tensor | None = None,
    shared_experts: SharedExperts | None = None,
) -> torch.Tensor:
    """Reference for `fused_moe` and the benchmark's baseline: the per-expert loop in fp32
    (plus `shared_output`). `shared_experts`' slots are stacked after the routed experts as
    ordinary experts. Returns [T, H] in hidden's dtype."""
    if shared_experts is not None:
        inter = w13.shape[1] // 2
        gate_up, down = shared_experts
        gate, up = gate_up.split(gate_up.shape[0] // 2)
        slots = range(shared_expert_slots(shared_experts, inter))
        part = [slice(j * inter, (j + 1) * inter) for j in slots]
        w13 = torch.cat([w13] + [torch.cat([gate[p], up[p]])[None] for p in part])
        w2 = torch.cat([w2] + [down[:, p][None] for p in part])
    out = moe_forward_native(hidden, w13, w2, topk_weights, topk_ids, torch.float32)
    if shared_output is None:
        return out
    return (out.float() + shared_output.float()).to(hidden.dtype)


def moe_router_ref(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `moe_router`: float32 gate logits, then the router's torch code.
    Returns (weights [T, k + num_shared] float32, ids [T, k + num_shared] int64)."""
    logits = x.float() @ weight.float().t()
    weights, ids = select_experts_native(
        logits,
        top_k,
        scoring=scoring,
        correction_bias=correction_bias,
        num_groups=num_groups,
        topk_group=topk_group,
        renormalize=renormalize,
        scale=scale,
    )
    return append_shared_experts(weights, ids, weight.shape[0], num_shared)


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference for `moe_align_block_size` (the torch version it replaced: a stable argsort
    by expert). Returns (sorted_ids, expert_ids, num_padded); the kernel may order the pairs
    within an expert's run differently."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_blocks = min(-(-max_padded // block_m), num_pairs)  # a used block holds a pair
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = (
        torch.arange(num_pairs, device=flat.device)
        - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    )
    dest = (padded_end - padded)[sorted_experts] + rank
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=flat.device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


# ---- KV store ------------------------------------------------------------------------------


def store_mla_kv_ref(
    kv_buffer: torch.Tensor,
    loc: torch.Tensor,
    latent_with_rope: torch.Tensor,
    k_scale: torch.Tensor | None = None,
) -> None:
    """Reference for `store_mla_kv` (writes in place)."""
    src = latent_with_rope.reshape(latent_with_rope.shape[0], 1, -1)
    _store_rows_ref(kv_buffer, loc, src, k_scale)


def store_kv_ref(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference for `store_kv` (writes in place)."""
    _store_rows_ref(k_buffer, loc, k, k_scale)
    _store_rows_ref(v_buffer, loc, v, v_scale)


def _store_rows_ref(
    buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None
) -> None:
    """buf[loc] = x, quantized with `scale` for an fp8 buffer."""
    if buf.dtype == FP8_DTYPE:
        assert scale is not None, "an fp8 pool needs its scale"
        buf[loc.long()] = quantize_fp8(x, scale)
    else:
        buf[loc.long()] = x.to(buf.dtype)


# ---- norms and activation -------------------------------------------------------------------
# NOTE: these run in the input's dtype, as the engine's torch code does: the kernels round where
# it rounds (the residual sum, the normalised row, the SiLU), so the two agree to the last bit
# but for the order of one fp32 sum.


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference for `rms_norm`: the torch-native RMSNorm."""
    return rms_norm_native(x, weight, eps)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `fused_add_rms_norm`: (rms_norm(x + residual), x + residual)."""
    return fused_add_rms_norm_native(x, residual, weight, eps)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference for `silu_and_mul`: F.silu(gate) * up."""
    return silu_and_mul_native(gate_up)


# ---- RoPE and the MLA preamble ---------------------------------------------------------------


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `rotary_embedding`: the torch code of `RotaryEmbedding`."""
    cos, sin = rope_cos_sin(positions, inv_freq, attention_scaling)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (
        apply_rope_native(q, cos, sin, interleaved),
        apply_rope_native(k, cos, sin, interleaved),
    )


def mla_preamble_ref(
    kv_a: torch.Tensor,
    q_pe: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `mla_preamble`: MLAAttention's torch code (kv_a_layernorm on c_kv, RoPE on
    q_pe and k_pe, the latent row concatenated). Returns (latent [T, C + R], q_pe [T, H, R])."""
    rope = q_pe.shape[-1]
    c_kv, k_pe = kv_a.split([kv_a.shape[-1] - rope, rope], dim=-1)
    c_kv = rms_norm_native(c_kv, norm_weight, eps)
    q_rot, k_rot = rotary_embedding_ref(
        positions, q_pe, k_pe.unsqueeze(1), inv_freq, attention_scaling, interleaved
    )
    return torch.cat([c_kv, k_rot.squeeze(1)], dim=-1), q_rot


# ---- FP8 batched matmul (MLA's absorbed weights) ---------------------------------------------


def bmm_fp8_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference for `bmm_fp8`: x [H, B, K] @ e4m3 w [H, K, N] per head, times scale [H, N]
    -> [H, B, N] fp32 (the engine's torch path, without the final rounding)."""
    return bmm_fp8_native(x.float(), w, scale)
