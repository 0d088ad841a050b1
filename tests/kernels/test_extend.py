"""Extend (prefill) attention against its PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.extend import extend_attention, ragged_attention
from engine.kernels.reference import extend_attention_ref, ragged_attention_ref


@pytest.mark.parametrize(
    "prefix,extend,hq,hkv,d,dv,dtype",
    [
        ([0], [1], 2, 2, 32, 32, torch.float32),  # batch 1, a single new token, no prefix
        ([0, 21, 5], [37, 4, 18], 4, 2, 32, 16, torch.float32),  # GQA, mixed prefix/extend
        ([17, 0], [9, 23], 2, 2, 48, 32, torch.bfloat16),  # MLA-like: D (192) > Dv (128) shape
    ],
)
def test_extend_attention(
    prefix: list[int],
    extend: list[int],
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    g = torch.Generator().manual_seed(sum(prefix) + sum(extend))
    batch, total_ext = len(prefix), sum(extend)
    num_slots = sum(prefix) + 4
    k_buf = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    v_buf = torch.randn(num_slots, hkv, dv, generator=g).to(dtype)
    rt = torch.zeros(batch + 1, max(prefix) + max(extend) + 2, dtype=torch.int32)
    slots = torch.randperm(num_slots - 1, generator=g)[: sum(prefix)] + 1
    off = 0
    for b, p in enumerate(prefix):
        rt[b + 1, :p] = slots[off : off + p].int()
        off += p
    rows = torch.arange(1, batch + 1)
    q = torch.randn(total_ext, hq, d, generator=g).to(dtype)
    k = torch.randn(total_ext, hkv, d, generator=g).to(dtype)
    v = torch.randn(total_ext, hkv, dv, generator=g).to(dtype)
    pl = torch.tensor(prefix, dtype=torch.int32)
    sl = pl + torch.tensor(extend, dtype=torch.int32)
    start = torch.cumsum(torch.tensor([0] + extend[:-1]), 0).int()
    args = [t.to(device) for t in (q, k, v, k_buf, v_buf, rt, rows, sl, pl, start)]
    out = extend_attention(*args, d**-0.5)
    ref = extend_attention_ref(*args, d**-0.5)
    tol = 1e-2 if dtype == torch.float32 else 3e-2
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol


@pytest.mark.parametrize(
    "prefix,extend,hq,hkv,dtype",
    [
        ([0], [1], 2, 2, torch.float32),  # one token, no prefix
        ([21, 0, 5], [4, 37, 18], 2, 2, torch.float32),  # mixed; extends not tile multiples
        ([17, 40], [9, 3], 4, 2, torch.bfloat16),  # grouped heads, prefix longer than the tile
    ],
)
def test_ragged_attention(
    prefix: list[int],
    extend: list[int],
    hq: int,
    hkv: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """MLA's prefill shape: D (192 on DeepSeek) > Dv (128), whole contexts given as rows."""
    d, dv = 48, 32
    g = torch.Generator().manual_seed(len(prefix) + sum(extend))
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    # A gap row between requests: reading past a request's own rows would show.
    kv_start = torch.tensor([sum(seq[:b]) + 3 * b for b in range(len(seq))], dtype=torch.int32)
    rows = int(kv_start[-1]) + seq[-1] + 3
    k = torch.randn(rows, hkv, d, generator=g).to(dtype)
    v = torch.randn(rows, hkv, dv, generator=g).to(dtype)
    q = torch.randn(sum(extend), hq, d, generator=g).to(dtype)
    q_start = torch.cumsum(torch.tensor([0] + extend[:-1]), 0).int()
    sl = torch.tensor(seq, dtype=torch.int32)
    pl = torch.tensor(prefix, dtype=torch.int32)
    args = [t.to(device) for t in (q, k, v, sl, pl, q_start, kv_start)]
    out = ragged_attention(*args, d**-0.5)
    ref = ragged_attention_ref(*args, d**-0.5)
    assert out.shape == (sum(extend), hq, dv)
    tol = 1e-2 if dtype == torch.float32 else 3e-2
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_attention_with_the_rope_part_apart(
    dtype: torch.dtype, device: torch.device
) -> None:
    """MLA's prefill without concatenating: q's and k's last R dims given apart (q_pe per head,
    k_pe one row for every head, as a [S, 1, R] view), equal to the concatenated call; a
    strided q (a view of a wider projection) and K/V heads as views of one [S, H, D + Dv]."""
    h, nope, rope, dv = 2, 32, 16, 32
    prefix, extend = [9, 0], [21, 5]
    g = torch.Generator().manual_seed(11)
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    kv_start = torch.tensor([0, seq[0]], dtype=torch.int32)
    rows = sum(seq)
    kv = torch.randn(rows, h, nope + dv, generator=g).to(dtype)
    k_nope, v = kv.split([nope, dv], dim=-1)
    k_pe = torch.randn(rows, 1, rope, generator=g).to(dtype)
    q_full = torch.randn(sum(extend), h, nope + rope + 8, generator=g).to(dtype)
    q_nope, q_pe = q_full[..., :nope], q_full[..., nope : nope + rope]
    q_start = torch.tensor([0, extend[0]], dtype=torch.int32)
    lens = [torch.tensor(x, dtype=torch.int32) for x in (seq, prefix)]
    common = [t.to(device) for t in (*lens, q_start, kv_start)]
    scale = (nope + rope) ** -0.5
    q_nope, q_pe, k_nope, k_pe, v = (t.to(device) for t in (q_nope, q_pe, k_nope, k_pe, v))
    out = ragged_attention(q_nope, k_nope, v, *common, scale, q_pe=q_pe, k_pe=k_pe)
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(-1, h, -1)], dim=-1)
    ref = ragged_attention_ref(q, k, v, *common, scale)
    assert out.shape == (sum(extend), h, dv)
    tol = 1e-2 if dtype == torch.float32 else 3e-2
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < tol
