"""Attention backends by name."""

from __future__ import annotations

import torch

from engine.config import ATTENTION_BACKENDS
from engine.layers.attention.base import AttentionBackend
from engine.mem_cache.kv_pool import KVPool


def make_attention_backend(name: str, kv_pool: KVPool, device: torch.device) -> AttentionBackend:
    """ "auto": Triton kernels on CUDA, the torch-native reference elsewhere."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch_native"
    if name == "triton":
        from engine.layers.attention.triton_backend import TritonBackend

        return TritonBackend(kv_pool)
    from engine.layers.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(kv_pool)
