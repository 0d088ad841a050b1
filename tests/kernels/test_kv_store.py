"""KV store kernels (bf16/fp16 and FP8 quantizing) against their PyTorch references."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.fp8 import dequantize_fp8, quantize_fp8
from engine.kernels.kv_store import gather_dequant, store_kv, store_mla_kv
from engine.kernels.reference import store_kv_ref, store_mla_kv_ref

C, R = 64, 16


def assert_fp8_store_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-exact on a GPU. Triton 3.9's interpreter rounds fp32 -> e4m3 its own way: some
    elements land one step off, and when rounding crosses a power of two it drops the carry
    (7.9 -> 4 instead of 8). On CPU those elements may be one step off or half."""
    if out.is_cuda or out.dtype != torch.float8_e4m3fn:
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
        return
    o, r = out.float(), ref.float()
    bad = o != r
    ok = ((o - r).abs() <= 0.125 * r.abs()) | (o * 2 == r)
    assert bool(torch.all(ok[bad])), (o[bad], r[bad])
    assert int(bad.sum()) <= 0.2 * o.numel()


@pytest.mark.parametrize("fp8", [False, True])
def test_store_mla_kv(fp8: bool, device: torch.device) -> None:
    g = torch.Generator().manual_seed(2)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    pool = torch.zeros(40, 1, C + R, dtype=dtype)
    pool_ref = pool.clone()
    loc = torch.tensor([3, 17, 5, 39, 1], dtype=torch.int64)
    rows = torch.randn(5, C + R, generator=g, dtype=torch.float32).to(torch.bfloat16) * 3
    k_scale = torch.tensor([0.01], device=device) if fp8 else None
    pool, pool_ref, loc, rows = (t.to(device) for t in (pool, pool_ref, loc, rows))
    store_mla_kv(pool, loc, rows, k_scale)
    store_mla_kv_ref(pool_ref, loc, rows, k_scale)
    assert_fp8_store_equal(pool, pool_ref)


@pytest.mark.parametrize("fp8", [False, True])
def test_store_kv(fp8: bool, device: torch.device) -> None:
    dtype = torch.float8_e4m3fn if fp8 else torch.float16
    kb = torch.zeros(20, 2, 24, dtype=dtype, device=device)
    vb = torch.zeros(20, 2, 16, dtype=dtype, device=device)
    kb_ref, vb_ref = kb.clone(), vb.clone()
    loc = torch.tensor([4, 9, 1], device=device)
    k = torch.randn(3, 2, 24, device=device)
    v = torch.randn(3, 2, 16, device=device)
    ks = torch.tensor([0.01], device=device) if fp8 else None
    vs = torch.tensor([0.02], device=device) if fp8 else None
    store_kv(kb, vb, loc, k, v, ks, vs)
    store_kv_ref(kb_ref, vb_ref, loc, k, v, ks, vs)
    assert_fp8_store_equal(kb, kb_ref)
    assert_fp8_store_equal(vb, vb_ref)


@pytest.mark.parametrize(
    "shape,slots,dtype",
    [
        ((40, 1, C + R), [3, 17, 5, 39, 1, 0, 17], torch.bfloat16),  # an MLA pool, a slot twice
        ((40, 1, 576), [[2, 9, 33], [4, 4, 38]], torch.bfloat16),  # V2's row width, 2-D slots
        ((20, 2, 24), [4, 9, 1], torch.float16),  # an MHA pool's K: heads x head_dim a row
        ((300, 1, 130), list(range(1, 300, 3)), torch.float32),  # rows past one program's 32
        ((10, 1, 64), [], torch.bfloat16),  # nothing to read
        ((30, 1, 576), [7, 2, 29], torch.float16),  # (sliced below: a row stride past its width)
    ],
)
def test_gather_dequant(
    shape: tuple[int, ...], slots: list, dtype: torch.dtype, device: torch.device
) -> None:
    """The one-pass read of an FP8 pool (`gather_dequant`'s kernel) against the torch form
    (`dequantize_fp8(buffer[slots], scale, dtype)`): the same bits."""
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    scale = torch.tensor([0.0173])
    pool = quantize_fp8(torch.randn(shape, generator=g) * 4, scale)
    if shape[-1] == 576 and dtype == torch.float16:
        pool = pool[..., :80]  # the first 80 columns of wider rows
    pool, scale = pool.to(device), scale.to(device)
    idx = torch.tensor(slots, dtype=torch.int64, device=device)
    out = gather_dequant(pool, idx, scale, dtype, kernel=True)
    ref = dequantize_fp8(pool[idx], scale, dtype)
    assert out.shape == ref.shape == (*idx.shape, *pool.shape[1:]) and out.dtype == dtype
    if out.is_cuda or dtype != torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        # Triton 3.9's interpreter casts fp32 to bf16 by dropping the low 16 bits (the GPU
        # rounds to nearest even, as torch does): each element is the product rounded either
        # way.
        wide = (pool[idx].float() * scale).view(torch.int32)
        cut = (wide >> 16).to(torch.int16)
        bits = out.view(torch.int16)
        assert bool(((bits == ref.view(torch.int16)) | (bits == cut)).all())
