"""Fused MoE against the per-expert PyTorch loop."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.fused_moe import fused_moe, moe_align_block_size
from engine.kernels.reference import fused_moe_ref


def test_moe_align_block_size(device: torch.device) -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=device)
    a = moe_align_block_size(ids, num_experts=4, block_m=4)
    n = int(a.num_padded.item())
    assert n == 12  # experts 0, 1, 2 each padded to one block of 4; expert 3 empty
    sorted_ids = a.sorted_ids[:n].view(3, 4).cpu()
    assert a.expert_ids[:3].tolist() == [0, 1, 2]
    flat = ids.reshape(-1).cpu()
    for blk in range(3):
        real = [int(i) for i in sorted_ids[blk] if i < flat.numel()]
        assert all(int(flat[i]) == blk for i in real)
    assert sorted(int(i) for i in a.sorted_ids.cpu() if i < flat.numel()) == list(range(6))


@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter,dtype",
    [
        (1, 8, 2, 64, 48, torch.float32),  # decode, batch 1
        (13, 8, 3, 64, 32, torch.float32),  # uneven expert loads; I not a tile multiple
        (40, 16, 6, 96, 64, torch.bfloat16),  # DeepSeek-style top-6, bf16
    ],
)
def test_fused_moe(
    tokens: int,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    g = torch.Generator().manual_seed(tokens * experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    topk_w, topk_ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    args = [t.to(device) for t in (x, w13, w2, topk_w, topk_ids)]
    out = fused_moe(*args)
    ref = fused_moe_ref(*args)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    tol = 1e-2 if dtype == torch.float32 else 3e-2
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol
