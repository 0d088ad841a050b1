"""SiLU-and-multiply: the gated MLP's activation over the merged gate/up projection's output.

`silu_and_mul(gate_up)` with gate_up [T, 2I] (gate columns, then up columns) returns
silu(gate) * up [T, I]. The rounding follows the torch code (`F.silu(gate) * up`): the SiLU is
rounded to the input's dtype before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import launch
from engine.kernels.utils import cdiv, next_power_of_2


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    stride_x, stride_out, inter,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> silu(gate_up[..., :I]) * gate_up[..., I:]  [..., I]."""
    inter = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * inter)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(gate_up.shape[:-1] + (inter,), dtype=gate_up.dtype, device=gate_up.device)
    rows = x.shape[0]
    if rows == 0:
        return out
    block = min(1024, next_power_of_2(inter))
    grid = (rows, cdiv(inter, block))
    launch(
        _silu_and_mul_kernel,
        grid,
        x,
        out,
        x.stride(0),
        inter,
        inter,
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
    )
    return out
