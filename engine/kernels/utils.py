"""Small helpers shared by the Triton kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def is_interpreter() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the current GPU (132 on an H200; 132 assumed on CPU)."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).multi_processor_count)
    return 132


@functools.cache
def has_fp8_cvt(device: torch.device) -> bool:
    """Whether the GPU has PTX's e4m3 -> f16 conversion (`cvt.rn.f16x2.e4m3x2`, sm_89+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# NOTE: Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly (it multiplies the raw
# 16-bit patterns), so on CPU the kernels upcast dot operands to fp32 first. On a GPU the flag
# is False and the dot runs on the tensor cores in the operands' own dtype.
INTERPRET_UPCAST = is_interpreter()


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation; upcasts the operands when UPCAST (interpreter only).

    fp32 operands are multiplied in full precision (not TF32): fp32 models are what the
    correctness tests compare against transformers.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out
