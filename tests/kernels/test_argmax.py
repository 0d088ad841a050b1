"""Greedy sampling's one-launch arg-max against torch.argmax."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.argmax import SLICE, argmax_rows
from engine.layers.sampler import first_argmax


@pytest.mark.parametrize("width", [1, 37, SLICE, 2 * SLICE + 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(width: int, dtype: torch.dtype, device: torch.device) -> None:
    """torch.argmax's index: ties within a slice and across slices (the first wins), NaN (the
    largest; the first of two), an all -inf row, the last column, a width that is no multiple of
    the slice, rows of a wider buffer, and no rows."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(7, width + 3, generator=g).to(dtype)[:, :width]
    top = float(x.float().max()) + 1.0
    x[4] = float("-inf")
    x[5, width - 1] = top
    if width > 20:
        x[1, width - 2] = x[1, 9] = top  # a tie across slices where the width has several
        x[2, 17] = x[2, 19] = top  # a tie within a slice
        x[3, 5] = float("nan")
        x[3, width - 1] = float("nan")
    x = x.to(device)
    want = torch.argmax(x.cpu(), dim=-1)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
    assert want[4] == 0 and want[5] == width - 1
    if width > 20:
        assert want[1] == 9 and want[2] == 17 and want[3] == 5
    assert torch.equal(first_argmax(x).cpu(), want)  # the sampler's entry (torch on CPU)
    assert argmax_rows(x[:0]).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_argmax_rows_matches_torch_on_cuda_at_vocab_width() -> None:
    """A decode batch's logits at DeepSeek-V2's vocabulary (102,400), fp32 as the sampler gets
    them, against torch.argmax on the same device."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 102_400, generator=g).cuda()
    x[7, 50_000] = x[7, 90_000] = x.max() + 1.0
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
