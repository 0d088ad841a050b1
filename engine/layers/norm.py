"""RMSNorm, computed in float32 as the reference implementations do.

The decoder layers carry the residual stream beside the hidden states (as SGLang and vLLM do), so
each norm after the first adds the residual in the same call: `forward_add(x, residual)` returns
(norm(x + residual), x + residual). On CUDA both forms run as one Triton kernel
(`engine.kernels.norm`); elsewhere the torch code below, which is also the kernels' reference.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.custom_ops import fused_add_rms_norm, rms_norm


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm_native(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_native(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # "auto": the Triton kernel on CUDA, the torch code elsewhere; tests set "triton" to run
        # the kernel under the interpreter, "native" to force the torch code.
        self.kernel = "auto"

    def uses_kernel(self, x: torch.Tensor) -> bool:
        return self.kernel == "triton" or (self.kernel == "auto" and x.is_cuda)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_kernel(x):
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_native(x, self.weight, self.eps)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        if self.uses_kernel(x):
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        return fused_add_rms_norm_native(x, residual, self.weight, self.eps)
