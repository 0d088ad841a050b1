"""RMSNorm kernels (plain and with the residual add fused) against the torch-native RMSNorm."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.norm import fused_add_rms_norm, rms_norm
from engine.kernels.reference import fused_add_rms_norm_ref, rms_norm_ref

EPS = 1e-6


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: to rounding; 16-bit: one step of the output's own rounding on a GPU (the kernels
    round where the torch code does, but sum the squares in another order). Triton 3.9's
    interpreter truncates fp32 -> bf16 instead of rounding, so on CPU allow three steps."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.float(), ref.float()
    if out.dtype == torch.float32:
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    else:
        steps = 1.01 if out.is_cuda else 3.01
        step = torch.finfo(out.dtype).eps * r.abs().clamp_min(1e-3)
        assert bool(((o - r).abs() <= step * steps).all()), (o - r).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 100), (3, 2048)])
def test_rms_norm(rows: int, n: int, dtype: torch.dtype, device: torch.device) -> None:
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(device)
    assert_close(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 96), (2, 1000)])
def test_fused_add_rms_norm(rows: int, n: int, dtype: torch.dtype, device: torch.device) -> None:
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, n, generator=g).to(dtype).to(device)
    res = (torch.randn(rows, n, generator=g) * 4).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(device)
    x0, res0 = x.clone(), res.clone()
    out, new_res = fused_add_rms_norm(x, res, w, EPS)
    ref, ref_res = fused_add_rms_norm_ref(x, res, w, EPS)
    if device.type == "cuda" or dtype == torch.float32:
        assert torch.equal(new_res, ref_res)  # one rounding of one add: bit-exact
    else:
        assert_close(new_res, ref_res)
    assert_close(out, ref)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # out of place


def test_rms_norm_strided_rows_and_3d(device: torch.device) -> None:
    """A column slice of a wider row (MLA's c_kv inside kv_a's output) and a [T, H, D] input."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(6, 80, generator=g).to(torch.bfloat16).to(device)
    x = wide[:, :48]  # row stride 80
    w = torch.randn(48, generator=g).to(torch.bfloat16).to(device)
    assert_close(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))
    x3 = torch.randn(3, 4, 32, generator=g).to(device)
    w3 = torch.randn(32, generator=g).to(device)
    assert_close(rms_norm(x3, w3, EPS), rms_norm_ref(x3, w3, EPS))
    empty = torch.empty(0, 32, device=device)
    assert rms_norm(empty, w3, EPS).shape == (0, 32)
