"""The few-row GEMV (decode steps' dense projections) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.gemv import MAX_BLOCK_K, MAX_ROWS, gemv


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
