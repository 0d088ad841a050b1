"""The FP8 batched matmul (MLA's absorbed weights in e4m3) against its torch reference, and the
per-output-channel quantization against the unquantized product."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.custom_ops_fp8 import _bmm_fp8_op
from engine.kernels.fp8 import FP8_DTYPE
from engine.kernels.fp8_bmm import bmm_fp8
from engine.kernels.reference import bmm_fp8_ref
from engine.layers.fp8_bmm import bmm_fp8_native, quantize_per_channel

# (heads, rows B, K, N): none a multiple of every tile size; B = 1 (decode) and B > 16 (two B
# tiles of 16), K over one BLOCK_K, N needing a masked last tile.
SHAPES = [(1, 1, 16, 16), (3, 5, 40, 70), (2, 1, 24, 130), (4, 33, 136, 20), (2, 17, 200, 9)]


def _case(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, seed: int):
    heads, rows, k, n = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(heads, rows, k, generator=g).to(dtype).to(device)
    # Channels of very different magnitudes: what a per-channel scale is for.
    w = torch.randn(heads, k, n, generator=g) * torch.logspace(-2, 1, n)
    q = quantize_per_channel(w.to(device), reduce_dim=1)
    return x, w.to(device), q


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to the output's rounding (the kernel and the reference sum in other orders)."""
    ulp = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-10
    tol = ulp * ref.abs().amax().item() + 1e-6
    assert (out.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bmm_fp8_matches_reference(shape, dtype, device: torch.device) -> None:
    x, _, q = _case(shape, dtype, device, seed=sum(shape))
    out = bmm_fp8(x, q.weight, q.scale)
    assert out.shape == (shape[0], shape[1], shape[3]) and out.dtype == dtype
    _close(out, bmm_fp8_ref(x, q.weight, q.scale))


def test_bmm_fp8_strided_operands(device: torch.device) -> None:
    """The model's call shapes: x a transposed [T, H, K] view, w the transpose of a [H, N, K]
    tensor (w_vc), the output written into a transposed view of a wider [T, H, N + pad] buffer."""
    heads, rows, k, n = 3, 6, 48, 20
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, heads, k, generator=g).to(torch.bfloat16).to(device).transpose(0, 1)
    w_vc = quantize_per_channel(torch.randn(heads, n, k, generator=g).to(device), reduce_dim=2)
    w = w_vc.weight.transpose(1, 2)  # [H, K, N], unit stride along K
    buf = torch.full((rows, heads, n + 8), 7.0, dtype=torch.bfloat16, device=device)
    out = bmm_fp8(x, w, w_vc.scale, out=buf[..., :n].transpose(0, 1))
    assert out.data_ptr() == buf.data_ptr()
    _close(buf[..., :n].transpose(0, 1), bmm_fp8_ref(x, w, w_vc.scale))
    assert (buf[..., n:] == 7.0).all(), "wrote outside its view"


@pytest.mark.parametrize("block_n", [16, 32])
def test_bmm_fp8_block_knobs(block_n: int, device: torch.device) -> None:
    x, _, q = _case((2, 40, 72, 50), torch.bfloat16, device, seed=3)
    out = bmm_fp8(x, q.weight, q.scale, block_b=32, block_n=block_n, block_k=32)
    _close(out, bmm_fp8_ref(x, q.weight, q.scale))


def test_bmm_fp8_empty_batch(device: torch.device) -> None:
    x, _, q = _case((2, 1, 16, 16), torch.bfloat16, device, seed=0)
    assert bmm_fp8(x[:, :0], q.weight, q.scale).shape == (2, 0, 16)


def test_per_channel_quantization_error() -> None:
    """e4m3 keeps 3 mantissa bits: every weight within 2^-4 of its value relative to its
    channel's largest, and the product within a few percent of the unquantized one."""
    x, w, q = _case((3, 5, 64, 40), torch.float32, torch.device("cpu"), seed=2)
    assert q.weight.dtype == FP8_DTYPE and q.scale.shape == (3, 40)
    deq = q.weight.float() * q.scale.unsqueeze(1)
    amax = w.abs().amax(dim=1, keepdim=True)
    assert ((deq - w).abs() <= amax * 2.0**-4).all()
    exact = torch.bmm(x, w)
    got = bmm_fp8_native(x, q.weight, q.scale)
    rel = (got - exact).norm() / exact.norm()
    assert rel < 0.05
    # A per-head scale would lose the small channels; per channel keeps them.
    small = slice(0, 5)
    assert (got[..., small] - exact[..., small]).norm() / exact[..., small].norm() < 0.05


def test_all_zero_channel_quantizes_to_zero() -> None:
    w = torch.randn(2, 8, 4)
    w[:, :, 1] = 0.0
    q = quantize_per_channel(w, reduce_dim=1)
    assert torch.isfinite(q.scale).all() and (q.weight[:, :, 1].float() == 0).all()


def test_bmm_fp8_custom_op(device: torch.device) -> None:
    x, _, q = _case((2, 3, 32, 24), torch.bfloat16, device, seed=4)
    # The fake implementation against the kernel. NOTE: opcheck's test_schema is left out: it
    # compares inputs before and after the call with ops that have no float8 implementation.
    utils = ("test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(_bmm_fp8_op, (x, q.weight, q.scale), test_utils=utils)


@pytest.mark.cuda
def test_bmm_fp8_v2_lite_shapes_on_gpu() -> None:
    """V2-Lite's absorbed GEMMs (16 heads; w_kc K=128 -> N=512, w_vc K=512 -> N=128) at the
    batch sizes the engine decodes with."""
    device = torch.device("cuda")
    for rows in (1, 16, 64, 256):
        for k, n in ((128, 512), (512, 128)):
            x, _, q = _case((16, rows, k, n), torch.bfloat16, device, seed=rows + k)
            _close(bmm_fp8(x, q.weight, q.scale), bmm_fp8_ref(x, q.weight, q.scale))
