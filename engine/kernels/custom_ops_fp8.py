"""The FP8 batched matmul of MLA's absorbed weights (`absorbed_weight_dtype="fp8_e4m3"`) as a
torch custom op (see `engine.kernels.custom_ops`: the op only while dynamo traces)."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kernels import fp8_bmm as _fp8_bmm
from engine.kernels.custom_ops import tracing as _tracing


@torch.library.custom_op("engine::bmm_fp8", mutates_args=())
def _bmm_fp8_op(x: Tensor, w: Tensor, scale: Tensor) -> Tensor:
    return _fp8_bmm.bmm_fp8(x, w, scale)


@_bmm_fp8_op.register_fake
def _(x: Tensor, w: Tensor, scale: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], x.shape[1], w.shape[2])


def bmm_fp8(x: Tensor, w: Tensor, scale: Tensor, out: Tensor | None = None) -> Tensor:
    """As `engine.kernels.fp8_bmm.bmm_fp8`. While tracing `out` is ignored (dynamo traces no
    kernel writing into a strided view): the caller copies the returned tensor itself."""
    if _tracing():
        return _bmm_fp8_op(x, w, scale)
    return _fp8_bmm.bmm_fp8(x, w, scale, out)
