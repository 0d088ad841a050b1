"""SiLU-and-multiply over a merged gate/up projection: the gated MLPs' activation.

On CUDA it runs as one Triton kernel (`engine.kernels.activation`); elsewhere the torch code
below, which is also the kernel's reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.custom_ops import silu_and_mul


def silu_and_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate, then up) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # "auto": the Triton kernel on CUDA, the torch code elsewhere ("triton" / "native" force
        # one, for tests).
        self.kernel = "auto"

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernel == "triton" or (self.kernel == "auto" and gate_up.is_cuda):
            return silu_and_mul(gate_up)
        return silu_and_mul_native(gate_up)
