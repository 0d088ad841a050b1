"""RoPE kernel against the torch code of RotaryEmbedding (plain and YaRN-scaled frequencies)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.reference import rotary_embedding_ref
from engine.kernels.rope import rotary_embedding


def assert_rope_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: to rounding. bf16: the torch code rounds after each product and the difference,
    the kernel once at the end; two steps of bf16 (three under the interpreter, which truncates
    fp32 -> bf16) of the rotated pair's size |(x_j, x_{j + D/2})|, which bounds those products."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    half = ref.shape[-1] // 2
    pair = (ref[..., :half].float() ** 2 + ref[..., half:].float() ** 2).sqrt()
    size = torch.cat([pair, pair], dim=-1).clamp_min(1)
    steps = 2.01 if out.is_cuda else 3.01
    err = (out.float() - ref.float()).abs()
    assert bool((err <= steps * torch.finfo(out.dtype).eps * size).all()), (err / size).max()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hq,hk,dim", [(1, 4, 2, 64), (5, 3, 1, 48), (3, 20, 20, 16)])
def test_rotary_embedding(
    tokens: int, hq: int, hk: int, dim: int, dtype: torch.dtype, interleaved: bool,
    device: torch.device,
) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(tokens * hq + dim)
    # Positions up to a long context: cos/sin of large arguments must agree too.
    positions = torch.randint(0, 160_000, (tokens,), generator=g).to(device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    inv_freq = (inv_freq * (1 + 0.1 * torch.rand(dim // 2, generator=g))).to(device)
    q = torch.randn(tokens, hq, dim, generator=g).to(dtype).to(device)
    k = torch.randn(tokens, hk, dim, generator=g).to(dtype).to(device)
    out_q, out_k = rotary_embedding(positions, q, k, inv_freq, 1.2, interleaved)
    ref_q, ref_k = rotary_embedding_ref(positions, q, k, inv_freq, 1.2, interleaved)
    assert_rope_close(out_q, ref_q)
    assert_rope_close(out_k, ref_k)


def test_rotary_embedding_on_strided_views(device: torch.device) -> None:
    """q and k as column slices of one fused projection output."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, 3, 2, 32, generator=g).to(device)  # [T, q|k|v, H, D]
    q, k = qkv[:, 0], qkv[:, 1]
    positions = torch.tensor([0, 1, 7, 300], device=device)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))).to(device)
    out = rotary_embedding(positions, q, k, inv_freq, 1.0, False)
    ref = rotary_embedding_ref(positions, q, k, inv_freq, 1.0, False)
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
