"""GQA/MHA decode against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.fp8 import quantize_fp8
from engine.kernels.gqa_decode import gqa_decode
from engine.kernels.reference import gqa_decode_ref


def _inputs(
    seq_lens: list[int], hq: int, hkv: int, d: int, dv: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(sum(seq_lens) + hq)
    total = sum(seq_lens)
    num_slots = total + 5
    k = torch.randn(num_slots, hkv, d, generator=g)
    v = torch.randn(num_slots, hkv, dv, generator=g)
    req_to_token = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 3, dtype=torch.int32)
    slots = torch.randperm(num_slots - 1, generator=g)[:total] + 1
    rows = torch.randperm(len(seq_lens) + 2, generator=g)[: len(seq_lens)]
    off = 0
    for b, n in enumerate(seq_lens):
        req_to_token[rows[b], :n] = slots[off : off + n].int()
        off += n
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    return tuple(t.to(device) for t in (q, k, v, req_to_token, rows, lens))


@pytest.mark.parametrize(
    "seq_lens,hq,hkv,d,dv,splits",
    [
        ([1], 4, 4, 32, 32, None),  # MHA, batch 1, one token
        ([19, 70, 3], 6, 2, 48, 32, 3),  # GQA group 3, head dim not a power of two
        ([45], 9, 3, 64, 64, 5),  # SmolLM2's grouping
    ],
)
def test_gqa_decode(
    seq_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    splits: int | None,
    device: torch.device,
) -> None:
    q, k, v, rt, rows, lens = _inputs(seq_lens, hq, hkv, d, dv, device)
    out = gqa_decode(q, k, v, rt, rows, lens, d**-0.5, num_kv_splits=splits)
    ref = gqa_decode_ref(q, k, v, rt, rows, lens, d**-0.5)
    assert out.shape == (len(seq_lens), hq, dv)
    assert float((out - ref).norm() / ref.norm()) < 1e-2


def test_gqa_decode_fp8(device: torch.device) -> None:
    q, k, v, rt, rows, lens = _inputs([7, 33], 8, 2, 32, 32, device)
    ks = torch.tensor([0.01], device=device)
    vs = torch.tensor([0.02], device=device)
    k8, v8 = quantize_fp8(k, ks), quantize_fp8(v, vs)
    q = q.to(torch.bfloat16)
    out = gqa_decode(q, k8, v8, rt, rows, lens, 0.2, k_scale=ks, v_scale=vs, num_kv_splits=2)
    ref = gqa_decode_ref(q, k8, v8, rt, rows, lens, 0.2, k_scale=ks, v_scale=vs)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-2
