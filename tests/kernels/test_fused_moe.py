"""Fused MoE against the per-expert PyTorch loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from engine.kernels import fused_moe as fused_moe_module
from engine.kernels.fused_moe import (
    INLINE_ALIGN_MAX_PAIRS,
    SharedExperts,
    _inline_block,
    default_moe_config,
    fused_moe,
    moe_align_block_size,
)
from engine.kernels.reference import fused_moe_ref, moe_align_block_size_ref


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
    assert sorted(int(i) for i in a.sorted_ids[:n].cpu() if i < flat.numel()) == list(range(6))


@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m,id_dtype",
    [
        (1, 6, 64, 16, torch.int32),  # V2-Lite decode at batch 1
        (300, 6, 64, 16, torch.int32),  # 1800 pairs: several placing programs
        (700, 6, 64, 128, torch.int32),  # 4200 pairs: more than one counting chunk, prefill tiles
        (40, 8, 256, 64, torch.int64),  # V3's expert count
        (13, 3, 10, 16, torch.int64),  # experts not a power of two
    ],
)
def test_moe_align_block_size_matches_reference(
    tokens: int, top_k: int, experts: int, block_m: int, id_dtype: torch.dtype, device: torch.device
) -> None:
    g = torch.Generator().manual_seed(tokens + experts)
    # Skewed loads: a few experts take most pairs, some none.
    probs = torch.rand(experts, generator=g) ** 4
    ids = torch.stack([torch.multinomial(probs, top_k, generator=g) for _ in range(tokens)])
    ids = ids.to(id_dtype).to(device)
    got = moe_align_block_size(ids, experts, block_m)
    ref_sorted, ref_experts, ref_num = moe_align_block_size_ref(ids, experts, block_m)
    assert torch.equal(got.num_padded, ref_num)
    assert torch.equal(got.expert_ids, ref_experts)
    assert got.sorted_ids.shape == ref_sorted.shape
    # The same pairs in each block (the kernel's order within an expert's run may differ).
    n = int(ref_num.item())
    blocks = got.sorted_ids[:n].view(-1, block_m).sort(dim=1)[0]
    ref_blocks = ref_sorted[:n].view(-1, block_m)
    run_sets_equal = [
        torch.equal(
            blocks[ref_experts[: n // block_m] == e].flatten().sort()[0],
            ref_blocks[ref_experts[: n // block_m] == e].flatten().sort()[0],
        )
        for e in range(experts)
    ]
    assert all(run_sets_equal)  # (the places past num_padded are not written: none is read)


def test_fused_moe_adds_the_shared_output(device: torch.device) -> None:
    g = torch.Generator().manual_seed(5)
    tokens, experts, top_k, hidden, inter = 7, 8, 2, 48, 32
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    topk_w, topk_ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(top_k)
    shared = torch.randn(tokens, hidden, generator=g)
    args = [t.to(device) for t in (x, w13, w2, topk_w, topk_ids)]
    out = fused_moe(*args, shared_output=shared.to(device))
    ref = fused_moe_ref(*args, shared_output=shared.to(device))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [1, 2])
def test_fused_moe_runs_the_shared_experts(
    slots: int, dtype: torch.dtype, device: torch.device
) -> None:
    """The shared MLP (intermediate slots x I) as always-on experts E.. of weight 1."""
    g = torch.Generator().manual_seed(slots)
    tokens, experts, top_k, hidden, inter = 9, 8, 2, 64, 48
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    gate_up = (torch.randn(2 * slots * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    down = (torch.randn(hidden, slots * inter, generator=g) / inter**0.5).to(dtype)
    topk_w, topk_ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(top_k)
    extra = torch.arange(experts, experts + slots).expand(tokens, slots)
    topk_w = torch.cat([topk_w, torch.ones(tokens, slots)], dim=1)
    topk_ids = torch.cat([topk_ids, extra], dim=1)
    args = [t.to(device) for t in (x, w13, w2, topk_w, topk_ids)]
    shared = SharedExperts(gate_up.to(device), down.to(device))
    out = fused_moe(*args, shared_experts=shared)
    ref = fused_moe_ref(*args, shared_experts=shared)
    # The slots are the shared MLP itself: down(silu(gate) * up) over the whole intermediate.
    mlp = torch.nn.functional.silu(x.float() @ gate_up.float()[: slots * inter].t())
    mlp = (mlp * (x.float() @ gate_up.float()[slots * inter :].t())) @ down.float().t()
    routed = fused_moe_ref(x, w13, w2, topk_w[:, :top_k], topk_ids[:, :top_k])
    torch.testing.assert_close(ref.float().cpu(), routed.float() + mlp, rtol=2e-2, atol=2e-2)
    tol = 1e-2 if dtype == torch.float32 else 3e-2
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol


@triton.jit
def _inline_blocks_kernel(
    ids_ptr, found_ptr, expert_ptr, rows_ptr, num_pairs,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    found, expert, rows = _inline_block(ids_ptr, num_pairs, pid, BLOCK_M, BLOCK_P, BLOCK_E)
    tl.store(found_ptr + pid, found.to(tl.int32))
    tl.store(expert_ptr + pid, expert.to(tl.int32))
    tl.store(rows_ptr + pid * BLOCK_M + tl.arange(0, BLOCK_M), rows)


@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m",
    [
        (1, 8, 66, 16),  # V2-Lite's batch-1 decode: 6 routed + 2 shared slots
        (16, 8, 66, 16),  # batch 16: 128 pairs (the kernel's block form holds past the limit)
        (5, 6, 8, 4),  # more pairs than an expert's block: several blocks per expert
        (3, 2, 10, 16),  # experts not a power of two
    ],
)
def test_inline_block_matches_alignment(
    tokens: int, top_k: int, experts: int, block_m: int, device: torch.device
) -> None:
    """Each GEMM program's own view of its block (decode batches) is the block the alignment
    makes: the same blocks in use, the same expert, the same pairs in the same order (by pair
    index, as the reference's stable sort), and pads past the pairs."""
    g = torch.Generator().manual_seed(tokens * experts + block_m)
    probs = torch.rand(experts, generator=g) ** 4
    ids = torch.stack([torch.multinomial(probs, top_k, generator=g) for _ in range(tokens)])
    ids = ids.to(torch.int32).to(device)
    ref_sorted, ref_experts, ref_num = moe_align_block_size_ref(ids, experts, block_m)
    blocks, pairs = ref_experts.shape[0], ids.numel()
    found = torch.empty(blocks, dtype=torch.int32, device=device)
    expert = torch.empty(blocks, dtype=torch.int32, device=device)
    rows = torch.empty(blocks, block_m, dtype=torch.int32, device=device)
    _inline_blocks_kernel[(blocks,)](
        ids.reshape(-1), found, expert, rows, pairs, BLOCK_M=block_m,
        BLOCK_P=max(16, triton.next_power_of_2(pairs)),
        BLOCK_E=max(16, triton.next_power_of_2(experts)),
    )  # fmt: skip
    used = int(ref_num.item()) // block_m
    assert found.tolist() == [1] * used + [0] * (blocks - used)
    assert torch.equal(expert[:used], ref_experts[:used])
    assert torch.equal(rows[:used].reshape(-1), ref_sorted[: used * block_m])


def _spy_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the fused MoE's launchers, in the order `fused_moe` calls them."""
    calls: list[str] = []

    def spy(name: str) -> Callable[..., Any]:
        launch = getattr(fused_moe_module, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return launch(*args, **kwargs)

        return run

    for name in ("_moe_gemm", "moe_align_block_size"):
        monkeypatch.setattr(fused_moe_module, name, spy(name))
    return calls


def _decode_inputs(
    tokens: int, slots: int, dtype: torch.dtype
) -> tuple[list[torch.Tensor], SharedExperts | None, torch.Tensor]:
    """x, w13, w2, topk weights and ids ([T, top_k + slots]), the shared experts (slots > 0) and
    a shared_output, at a small decode shape (top-2 of 8 experts, H 64, I 48)."""
    g = torch.Generator().manual_seed(100 * tokens + slots)
    experts, top_k, hidden, inter = 8, 2, 64, 48
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    topk_w, topk_ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(top_k)
    shared = None
    if slots:
        gate_up = (torch.randn(2 * slots * inter, hidden, generator=g) / hidden**0.5).to(dtype)
        down = (torch.randn(hidden, slots * inter, generator=g) / inter**0.5).to(dtype)
        shared = SharedExperts(gate_up, down)
        topk_w = torch.cat([topk_w, torch.ones(tokens, slots)], dim=1)
        topk_ids = torch.cat(
            [topk_ids, torch.arange(experts, experts + slots).expand(tokens, -1)], 1
        )
    shared_output = torch.randn(tokens, hidden, generator=g).to(dtype)
    return [x, w13, w2, topk_w, topk_ids], shared, shared_output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [0, 2])
@pytest.mark.parametrize("with_shared_output", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_fused_moe_decode(
    tokens: int,
    with_shared_output: bool,
    slots: int,
    dtype: torch.dtype,
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode batches (the grouped GEMMs at 2-12 pairs) against the per-expert loop."""
    calls = _spy_kernels(monkeypatch)
    args, shared, shared_output = _decode_inputs(tokens, slots, dtype)
    args = [t.to(device) for t in args]
    if shared is not None:
        shared = SharedExperts(shared.gate_up.to(device), shared.down.to(device))
    extra = shared_output.to(device) if with_shared_output else None
    out = fused_moe(*args, shared_output=extra, shared_experts=shared)
    ref = fused_moe_ref(*args, shared_output=extra, shared_experts=shared)
    assert calls == ["_moe_gemm", "_moe_gemm"]  # few pairs: no alignment kernel
    assert out.shape == ref.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:
        assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 3e-2


@pytest.mark.parametrize(
    "tokens,top_k,forced",
    [
        (1, 8, False),  # 8 pairs, as V2-Lite's batch-1 decode (6 routed + 2 shared)
        (5, 4, False),
        (1, 8, True),  # an explicit config (the tuner's way to time tiles)
        (4, 8, False),  # 32 pairs: the most that align inside the GEMMs, 4 an expert
        (16, 8, False),  # 128 pairs, 16 an expert: the alignment kernel
        (40, 4, False),  # 160 pairs: the alignment kernel
    ],
)
def test_fused_moe_dispatch(
    tokens: int,
    top_k: int,
    forced: bool,
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every batch, with the default tiles or an explicit config, runs the two grouped GEMMs
    (after the alignment kernel above INLINE_ALIGN_MAX_PAIRS pairs) and gives the reference's
    answer."""
    calls = _spy_kernels(monkeypatch)
    g = torch.Generator().manual_seed(tokens + top_k)
    experts, hidden, inter = 8, 32, 32
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    topk_w, topk_ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(top_k)
    args = [t.to(device) for t in (x, w13, w2, topk_w, topk_ids)]
    config = default_moe_config(tokens * top_k, experts, 4) if forced else None
    out = fused_moe(*args, config=config)
    inline = tokens * top_k <= INLINE_ALIGN_MAX_PAIRS
    assert calls == ([] if inline else ["moe_align_block_size"]) + ["_moe_gemm", "_moe_gemm"]
    torch.testing.assert_close(out, fused_moe_ref(*args), rtol=1e-4, atol=1e-4)
