"""FP8 weights for MLA's absorbed batched matmuls (`absorbed_weight_dtype="fp8_e4m3"`).

W_UK (w_kc) and W_UV (w_vc) are quantized once, after loading, to float8_e4m3fn with one fp32
scale per head and output channel: the absorbed GEMM out[h, :, n] = x[h] @ w[h, :, n] reads
column n of head h with one scale, so the scale factors out of the sum over k and is applied
once to the fp32 result (the kernel's epilogue). Per output channel rather than per head: the
rows of kv_b_proj that make a head's channels differ in magnitude, and a per-head scale would
spend e4m3's 3 mantissa bits of the small channels on the range of the largest; the scales cost
H * N * 4 bytes beside H * K * N weight bytes (1/32 for V2-Lite's w_vc, K = 512; 1/128 for w_kc).

On CUDA the GEMM is the Triton kernel of `engine.kernels.fp8_bmm`; elsewhere `bmm_fp8_native`
below, which is also the kernel's reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.config import ConfigError
from engine.kernels.fp8 import FP8_DTYPE, FP8_MAX
from engine.kernels.utils import has_fp8_cvt

# Smallest scale: an all-zero channel quantizes to zeros instead of dividing by zero.
_MIN_SCALE = 1e-12


class Fp8Weight(NamedTuple):
    """An e4m3 weight and its fp32 scales: weight * scale (broadcast over the reduced dim) is the
    real weight."""

    weight: torch.Tensor
    scale: torch.Tensor


def quantize_per_channel(w: torch.Tensor, reduce_dim: int) -> Fp8Weight:
    """w [H, ...] -> e4m3 of the same shape (and strides, contiguous) and fp32 scales with
    `reduce_dim` removed: amax over that dim / 448, so every channel uses e4m3's full range."""
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=reduce_dim, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous()
    return Fp8Weight(q, scale.squeeze(reduce_dim).contiguous())


def bmm_fp8_native(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [H, B, K]; w [H, K, N] e4m3; scale [H, N] fp32 -> [H, B, N] in x's dtype (into `out`
    when given). The kernel's maths: e4m3 -> fp32 exactly, fp32 products and sums, the scale
    applied once to the result."""
    y = torch.bmm(x.float(), w.float()) * scale.unsqueeze(1)
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def check_fp8_absorbed_weights(device: torch.device) -> None:
    """Raise ConfigError unless `absorbed_weight_dtype="fp8_e4m3"` can run on `device` (an MLA
    model's; `CausalLM.set_absorbed_weight_dtype` refuses the option for the others)."""
    if not fp8_casts_work(device):
        raise ConfigError(
            f"absorbed_weight_dtype='fp8_e4m3': torch {torch.__version__} has no float8_e4m3fn "
            f"casts on {device.type}; use absorbed_weight_dtype='auto'"
        )
    if device.type == "cuda" and not has_fp8_cvt(device):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ConfigError(
            "absorbed_weight_dtype='fp8_e4m3' needs a GPU with FP8 conversions (compute "
            f"capability 8.9 or newer: Ada, Hopper); this one is {cap}"
        )


def fp8_casts_work(device: torch.device) -> bool:
    """Whether this torch casts to and from float8_e4m3fn on `device` (what the quantization and
    the torch path run; CPU builds without FP8 kernels fail here)."""
    try:
        probe = torch.ones(2, device=device).to(FP8_DTYPE)
        return bool(probe.float().sum().item() == 2.0)
    except (RuntimeError, TypeError, AttributeError):
        return False
