"""The few-row GEMV (decode steps' dense projections) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.gemv import MAX_BLOCK_K, MAX_ROWS, MAX_WEIGHT_BYTES, gemv, gemv_wanted
from engine.layers.linear import linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 37, 96), (3, 8, 200), (MAX_ROWS, 21, MAX_BLOCK_K + 40)])
def test_gemv_matches_linear(
    m: int, n: int, k: int, with_bias: bool, dtype: torch.dtype, device: torch.device
) -> None:
    """N not a tile multiple; K under, over (a K loop) and not a power of two; 1 to MAX_ROWS
    rows; x a strided view (rows of a wider buffer)."""
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k + 5, generator=g).to(dtype).to(device)[:, :k]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device) if with_bias else None
    out = gemv(x, w, bias)
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_gemv_rejects_more_rows() -> None:
    with pytest.raises(AssertionError, match="at most"):
        gemv(torch.zeros(MAX_ROWS + 1, 8), torch.zeros(4, 8))


def test_gemv_wanted() -> None:
    """One row of one 16-bit dtype on CUDA, contiguous weight rows, weights under the cap;
    "triton" forces it (fp32 too, any device), "native" never takes it."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not gemv_wanted(x, w)  # auto: CUDA only
    assert gemv_wanted(x, w, "triton") and not gemv_wanted(x, w, "native")
    assert not gemv_wanted(torch.zeros(2, 64, dtype=torch.bfloat16), w, "triton")  # 2 rows
    assert not gemv_wanted(x.float(), w, "triton")  # dtypes differ
    assert gemv_wanted(x.float(), w.float(), "triton")
    assert not gemv_wanted(x, torch.zeros(64, 32, dtype=torch.bfloat16).t(), "triton")
    big = torch.empty(MAX_WEIGHT_BYTES // 128 + 1, 64, dtype=torch.bfloat16, device="meta")
    assert not gemv_wanted(x, big, "triton")
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert gemv_wanted(xc, wc) and not gemv_wanted(xc.float(), wc.float())


def test_linear_dispatch(device: torch.device) -> None:
    """`linear` gives F.linear's answer on both paths, and more rows go to F.linear."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(24, 32, generator=g) / 32**0.5).to(device)
    bias = torch.randn(24, generator=g).to(device)
    for m in (1, 3):
        x = torch.randn(m, 32, generator=g).to(device)
        ref = F.linear(x, w, bias)
        for kernel in ("triton", "native"):
            torch.testing.assert_close(linear(x, w, bias, kernel), ref, rtol=1e-4, atol=1e-4)
