"""The one-kernel MoE router (gate GEMM, scores, grouped top-k, weights) against the torch code."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.moe_router import gate_logit_splits, gate_logits, moe_router
from engine.kernels.reference import moe_router_ref

# name: (experts, top_k, options); V2-Lite is plain top-6 of 64 softmax scores, V3 grouped
# sigmoid top-8 with the correction bias, V2 (full) the group-limited softmax.
CASES = {
    "v2-lite": (64, 6, dict(scoring="softmax", scale=1.0)),
    "v2-scaled": (20, 3, dict(scoring="softmax", scale=16.0)),
    "v2-renorm": (16, 4, dict(scoring="softmax", renormalize=True)),
    "v2-grouped": (24, 4, dict(scoring="softmax", num_groups=4, topk_group=2, scale=2.0)),
    "v3": (32, 8, dict(scoring="sigmoid", num_groups=8, topk_group=4, renormalize=True)),
    "v3-one-group": (12, 3, dict(scoring="sigmoid", renormalize=True, scale=2.5)),
}


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (weight, id) pairs in id order (top-k order is unspecified)."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize("fuse_gate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_router(case: str, dtype: torch.dtype, fuse_gate: bool, device: torch.device) -> None:
    experts, top_k, opts = CASES[case]
    tokens, hidden = 19, 72  # more than one token block, hidden not a tile multiple
    g = torch.Generator().manual_seed(experts * top_k)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    w = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype).to(device)
    if opts["scoring"] == "sigmoid":
        opts = {**opts, "correction_bias": (0.3 * torch.randn(experts, generator=g)).to(device)}
    out = moe_router(x, w, top_k, fuse_gate=fuse_gate, **opts)  # type: ignore[arg-type]
    ref_w, ref_ids = moe_router_ref(x, w, top_k, **opts)  # type: ignore[arg-type]
    assert out.topk_weights.shape == (tokens, top_k) and out.topk_weights.dtype == torch.float32
    assert out.topk_ids.dtype == torch.int32
    got_w, got_ids = _sorted(out.topk_weights, out.topk_ids)
    ref_w, ref_ids = _sorted(ref_w, ref_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)


def test_router_single_token_and_empty(device: torch.device) -> None:
    """Decode at batch 1 (one token in a block of 16) and an empty batch."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2048 // 16, generator=g).to(device)
    w = torch.randn(64, 2048 // 16, generator=g).to(device)
    out = moe_router(x, w, 6)
    ref_w, ref_ids = moe_router_ref(x, w, 6)
    got = _sorted(out.topk_weights, out.topk_ids)
    assert torch.equal(got[1], _sorted(ref_w, ref_ids)[1])
    empty = moe_router(x[:0], w, 6)
    assert empty.topk_ids.shape == (0, 6)


@pytest.mark.parametrize("splits", [1, 3, 4])
def test_gate_logits(splits: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(21, 300, generator=g).to(torch.bfloat16).to(device)
    w = torch.randn(40, 300, generator=g).to(torch.bfloat16).to(device)
    out = gate_logits(x, w, splits)  # H 300 in slices of 128: a 4th split is empty (zeros)
    assert out.dtype == torch.float32 and out.shape == (splits, 21, 40)
    torch.testing.assert_close(out.sum(0), x.float() @ w.float().t(), rtol=1e-5, atol=1e-3)


def test_router_sums_the_split_gate_logits(device: torch.device) -> None:
    """A decode-sized batch over a wide hidden size: the gate runs in H splits (2 here)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 600, generator=g).to(device)
    w = torch.randn(24, 600, generator=g).to(device)
    assert gate_logit_splits(3, 24, 600) == 2
    out = moe_router(x, w, 4, renormalize=True)
    ref_w, ref_ids = moe_router_ref(x, w, 4, renormalize=True)
    got, ref = _sorted(out.topk_weights, out.topk_ids), _sorted(ref_w, ref_ids)
    assert torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)


def test_router_appends_the_shared_experts(device: torch.device) -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 32, generator=g).to(device)
    w = torch.randn(16, 32, generator=g).to(device)
    out = moe_router(x, w, 3, renormalize=True, scale=2.5, num_shared=2)
    ref_w, ref_ids = moe_router_ref(x, w, 3, renormalize=True, scale=2.5, num_shared=2)
    assert out.topk_ids.shape == (5, 5)
    assert out.topk_ids[:, 3:].tolist() == [[16, 17]] * 5
    assert bool((out.topk_weights[:, 3:] == 1).all())
    got_w, got_ids = _sorted(out.topk_weights, out.topk_ids)
    ref_w, ref_ids = _sorted(ref_w, ref_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,experts", [(1, 2048, 64), (4, 300, 20)])
def test_norm_gate_logits(
    tokens: int, hidden: int, experts: int, dtype: torch.dtype, device: torch.device
) -> None:
    """The fused add + RMSNorm with the gate logits in one launch: the norm's outputs as the
    norm kernel gives them, the partial logits summing to the gate of the normed row, and the
    router on them picking what it picks from the normed row itself."""
    from engine.kernels.moe_router import norm_gate_logits
    from engine.kernels.norm import fused_add_rms_norm

    g = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    res = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype).to(device)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    gate = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype).to(device)
    out, new_res, partials = norm_gate_logits(x, res, norm_w, 1e-6, gate)
    ref_out, ref_res = fused_add_rms_norm(x, res, norm_w, 1e-6)
    assert torch.equal(new_res, ref_res)
    # The sum of squares may be reduced in another order: one rounding step of the output.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    assert partials.dim() == 3 and partials.shape[1:] == (tokens, experts)
    logits = out.float() @ gate.float().T
    torch.testing.assert_close(partials.sum(0), logits, rtol=1e-4, atol=1e-4)
    empty = norm_gate_logits(x[:0], res[:0], norm_w, 1e-6, gate)
    assert [t.shape[-2] if t.dim() == 3 else t.shape[0] for t in empty] == [0, 0, 0]
    got = moe_router(out, gate, 6, gate_partials=partials)
    want = moe_router(out, gate, 6, fuse_gate=False)
    assert torch.equal(_sorted(*got)[1], _sorted(*want)[1])
    torch.testing.assert_close(_sorted(*got)[0], _sorted(*want)[0], rtol=1e-4, atol=1e-5)
