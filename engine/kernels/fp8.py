"""FP8 (e4m3) KV storage: the dtype, its range, and the torch quantize / dequantize.

A stored value times its per-layer scale is the real value. The scale is a Python float (the
pools) or a [1] fp32 tensor (the kernels' launch arguments); both work below.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale in fp32, clamped to e4m3's range, cast to FP8_DTYPE."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(
    x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x * scale in fp32, cast to `dtype`."""
    return (x.float() * scale).to(dtype)
