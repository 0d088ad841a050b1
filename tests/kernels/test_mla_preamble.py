"""MLA preamble kernel (latent RMSNorm, RoPE on q_pe and k_pe, the latent row) against
MLAAttention's torch code."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kv_store import store_mla_kv
from engine.kernels.mla_preamble import PoolRow, mla_preamble, mla_preamble_absorb
from engine.kernels.reference import mla_preamble_ref

EPS = 1e-6


def pair_scale(x: torch.Tensor) -> torch.Tensor:
    """|(x_j, x_{j + D/2})| at both j and j + D/2: the size of the rotated pair, which bounds
    the products the torch code rounds on the way."""
    half = x.shape[-1] // 2
    m = (x[..., :half].float() ** 2 + x[..., half:].float() ** 2).sqrt()
    return torch.cat([m, m], dim=-1)


def assert_close(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """fp32: to rounding. bf16: the torch code rounds after each product and at the norm's
    steps, the kernel once; a few steps of bf16 of the values' scale (`scale`, default the
    values themselves), one more under the interpreter, which truncates fp32 -> bf16."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    steps = 2.01 if out.is_cuda else 3.01
    size = (ref.float().abs() if scale is None else scale).clamp_min(1)
    err = (out.float() - ref.float()).abs()
    assert bool((err <= steps * torch.finfo(out.dtype).eps * size).all()), (err / size).max()


def assert_preamble_close(
    out: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor], rope: int
) -> None:
    (latent, q_rot), (ref_latent, ref_q) = out, ref
    assert_close(latent[:, :-rope], ref_latent[:, :-rope])
    assert_close(latent[:, -rope:], ref_latent[:, -rope:], pair_scale(ref_latent[:, -rope:]))
    assert_close(q_rot, ref_q, pair_scale(ref_q))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,heads,rank,rope",
    [(1, 16, 512, 64), (5, 3, 96, 16), (2, 20, 40, 32)],  # V2-Lite decode; odd sizes
)
def test_mla_preamble(
    tokens: int, heads: int, rank: int, rope: int, dtype: torch.dtype, interleaved: bool,
    device: torch.device,
) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(tokens * heads + rank)
    nope = 24
    # kv_a_proj's output row and the query [T, H, nope + rope], of which q_pe is a view.
    kv_a = (torch.randn(tokens, rank + rope, generator=g) * 2).to(dtype).to(device)
    q = torch.randn(tokens, heads, nope + rope, generator=g).to(dtype).to(device)
    q_pe = q[..., nope:]
    w = (1 + 0.1 * torch.randn(rank, generator=g)).to(dtype).to(device)
    positions = torch.randint(0, 4000, (tokens,), generator=g).to(device)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, rope, 2).float() / rope))).to(device)
    args = (kv_a, q_pe, w, EPS, positions, inv_freq, 1.3, interleaved)
    ref_latent, ref_q = mla_preamble_ref(*args)
    assert_preamble_close(mla_preamble(*args), (ref_latent, ref_q), rope)
    # Into the absorbed query's last rope columns, leaving the others alone.
    q_abs = torch.zeros(tokens, heads, rank + rope, dtype=dtype, device=device)
    _, into = mla_preamble(*args, q_pe_out=q_abs[..., rank:])
    assert into.data_ptr() == q_abs[..., rank:].data_ptr()
    assert_close(q_abs[..., rank:], ref_q, pair_scale(ref_q))
    assert bool((q_abs[..., :rank] == 0).all())


def test_mla_preamble_strided_kv_rows(device: torch.device) -> None:
    """kv_a as a column slice of a wider projection output (V3 fuses q_a and kv_a)."""
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(3, 40 + 48 + 16, generator=g).to(device)
    kv_a = wide[:, 40:]
    q_pe = torch.randn(3, 4, 16, generator=g).to(device)
    w = torch.randn(48, generator=g).to(device)
    positions = torch.tensor([3, 0, 77], device=device)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))).to(device)
    args = (kv_a, q_pe, w, EPS, positions, inv_freq, 1.0, True)
    assert_preamble_close(mla_preamble(*args), mla_preamble_ref(*args), 16)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mla_preamble_stores_into_the_pool(pool_dtype: torch.dtype, device: torch.device) -> None:
    """With a PoolRow the latent rows land in the pool at their slots, byte for byte what the
    store kernel writes from the returned latent (FP8: quantized by the same scale); no other
    slot is touched."""
    g = torch.Generator().manual_seed(11)
    tokens, heads, rank, rope = 3, 4, 64, 16
    kv_a = (torch.randn(tokens, rank + rope, generator=g) * 2).to(torch.bfloat16).to(device)
    q_pe = torch.randn(tokens, heads, rope, generator=g).to(torch.bfloat16).to(device)
    w = (1 + 0.1 * torch.randn(rank, generator=g)).to(torch.bfloat16).to(device)
    positions = torch.tensor([5, 0, 300], device=device)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, rope, 2).float() / rope))).to(device)
    args = (kv_a, q_pe, w, EPS, positions, inv_freq, 1.0, True)
    loc = torch.tensor([7, 2, 12], device=device)
    scale = torch.tensor([0.05], device=device) if pool_dtype == torch.float8_e4m3fn else None
    fused = torch.zeros(16, 1, rank + rope, device=device).to(pool_dtype)
    latent, q_rot = mla_preamble(*args, store=PoolRow(fused.view(16, -1), loc, scale))
    stored = torch.zeros_like(fused)
    store_mla_kv(stored, loc, latent, scale)
    assert torch.equal(fused.view(torch.uint8), stored.view(torch.uint8))
    others = torch.ones(16, dtype=torch.bool)
    others[loc.cpu()] = False
    assert torch.count_nonzero(fused.view(torch.uint8)[others.to(device)]) == 0
    assert_preamble_close((latent, q_rot), mla_preamble_ref(*args), rope)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,heads,rank,rope,nope",
    [(1, 16, 512, 64, 128), (4, 3, 96, 16, 32)],  # V2-Lite decode; C not a multiple of 64
)
def test_mla_preamble_absorb(
    tokens: int, heads: int, rank: int, rope: int, nope: int, dtype: torch.dtype,
    device: torch.device,
) -> None:  # fmt: skip
    """W_UK in the preamble's launch: the absorbed query [q_nope @ W_UK | RoPE(q_pe)] and the
    latent rows, stored byte for byte as the store kernel stores them."""
    g = torch.Generator().manual_seed(tokens + heads)
    kv_a = (torch.randn(tokens, rank + rope, generator=g) * 2).to(dtype).to(device)
    q = torch.randn(tokens, heads, nope + rope, generator=g).to(dtype).to(device)
    w_kc = (torch.randn(heads, nope, rank, generator=g) / nope**0.5).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(rank, generator=g)).to(dtype).to(device)
    positions = torch.randint(0, 4000, (tokens,), generator=g).to(device)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, rope, 2).float() / rope))).to(device)
    args = (w, EPS, positions, inv_freq, 1.3, True)
    loc = torch.arange(tokens, device=device) * 2 + 1
    pool = torch.zeros(2 * tokens + 2, rank + rope, dtype=dtype, device=device)
    q_abs = torch.full((tokens, heads, rank + rope), float("nan"), dtype=dtype, device=device)
    latent = mla_preamble_absorb(kv_a, q, w_kc, q_abs, *args, store=PoolRow(pool, loc, None))
    ref_latent, ref_q = mla_preamble_ref(kv_a, q[..., nope:], *args)
    assert_preamble_close((latent, q_abs[..., rank:]), (ref_latent, ref_q), rope)
    ref_abs = torch.einsum("thn,hnc->thc", q[..., :nope].float(), w_kc.float())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q_abs[..., :rank].float(), ref_abs, rtol=tol, atol=tol)
    stored = torch.zeros_like(pool)
    store_mla_kv(stored.unsqueeze(1), loc, latent, None)
    assert torch.equal(pool, stored)
