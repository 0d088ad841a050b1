"""The small-M per-head GEMM (MLA's absorbed weights at decode) against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.small_gemm import MAX_ROWS, small_gemm_wanted, small_matmul


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 72, 96), (3, 40, 64), (16, 33, 50)])
def test_small_matmul_2d_matches_torch(
    m: int, n: int, k: int, with_bias: bool, dtype: torch.dtype, device: torch.device
) -> None:
    """N and K not tile multiples; 1 to MAX_ROWS rows; nn.Linear's weight as w = weight.t()."""
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device) if with_bias else None
    out = small_matmul(x, w.t(), bias=bias)
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_matmul_batched_strided(dtype: torch.dtype, device: torch.device) -> None:
    """The absorbed MLA weights' form: per head, x a transposed view of [T, H, K], w either
    [H, K, N] (W_UK) or a transposed [H, N, K] (W_UV), out a strided view of a wider buffer."""
    g = torch.Generator().manual_seed(7)
    t, h, k, n = 3, 4, 48, 40
    q = torch.randn(t, h, k + 8, generator=g).to(dtype).to(device)
    x = q[..., :k].transpose(0, 1)  # [H, T, K], strided
    w_kn = (torch.randn(h, k, n, generator=g) / k**0.5).to(dtype).to(device)
    w_nk = (torch.randn(h, n, k, generator=g) / k**0.5).to(dtype).to(device).transpose(1, 2)
    for w in (w_kn, w_nk):
        buf = torch.zeros(t, h, n + 8, dtype=dtype, device=device)
        dst = buf[..., :n].transpose(0, 1)  # [H, T, N], strided
        small_matmul(x, w, out=dst)
        ref = torch.bmm(x.float(), w.float())
        torch.testing.assert_close(dst.float(), ref, **_tol(dtype))
        assert torch.count_nonzero(buf[..., n:]) == 0  # nothing written past the view


def test_small_gemm_wanted() -> None:
    """Per-head GEMMs of few rows and one dtype, 16-bit on CUDA; "triton" forces the kernel
    (fp32 too, any device), "native" never takes it."""
    x = torch.zeros(16, 4, 64, dtype=torch.bfloat16)
    w = torch.zeros(16, 64, 32, dtype=torch.bfloat16)
    assert not small_gemm_wanted(x, w)  # auto: CUDA only
    assert small_gemm_wanted(x, w, "triton")
    assert not small_gemm_wanted(x, w, "native")
    assert not small_gemm_wanted(
        torch.zeros(16, MAX_ROWS + 1, 64, dtype=torch.bfloat16), w, "triton"
    )
    assert not small_gemm_wanted(x[0], w[0], "triton")  # 2-D: not a per-head GEMM
    assert not small_gemm_wanted(x.float(), w, "triton")  # dtypes differ
    assert small_gemm_wanted(x.float(), w.float(), "triton")
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert small_gemm_wanted(xc, wc) and not small_gemm_wanted(xc.float(), wc.float())
