"""Kernel tests run on the GPU where there is one, else on CPU through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
