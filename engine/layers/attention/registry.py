"""Attention backends by name."""

from __future__ import annotations

import torch

from engine.config import ATTENTION_BACKENDS, ConfigError
from engine.layers.attention.base import AttentionBackend
from engine.mem_cache.kv_pool import KVPool, MLATokenToKVPool


def make_attention_backend(
    name: str, kv_pool: KVPool, device: torch.device, mla_decode_kernel: str = "auto"
) -> AttentionBackend:
    """ "auto": Triton kernels on CUDA, the torch-native reference elsewhere.
    `mla_decode_kernel` (`EngineConfig.mla_decode_kernel`) "gluon" is checked against the pool
    and the GPU here, so that a setting that cannot run is refused at start; "auto" takes the
    Gluon kernel wherever that check passes."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch_native"
    refusal = _gluon_decode_refusal(name, kv_pool, device)
    if mla_decode_kernel == "gluon" and refusal:
        raise ConfigError(refusal)
    gluon = mla_decode_kernel in ("gluon", "auto") and refusal is None
    if name == "triton":
        from engine.layers.attention.triton_backend import TritonBackend

        return TritonBackend(kv_pool, gluon_decode=gluon)
    from engine.layers.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(kv_pool)


def _gluon_decode_refusal(backend: str, kv_pool: KVPool, device: torch.device) -> str | None:
    """Why the Gluon MLA decode kernel cannot run here, or None: it needs the Triton backend,
    an MLA model's FP8 latent pool and a GPU and shapes it serves (`mla_decode_gluon.fits`)."""
    where = "mla_decode_kernel='gluon'"
    if not isinstance(kv_pool, MLATokenToKVPool) or not kv_pool.is_fp8:
        return f"{where} applies to MLA models (DeepSeek-V2/V3) with an FP8 cache"
    from engine.kernels import mla_decode_gluon

    rope = kv_pool.qk_rope_head_dim
    if not mla_decode_gluon.fits(device, kv_pool.kv_lora_rank, rope, kv_pool.page_size):
        return (
            f"{where} needs a Hopper GPU (sm_90; this is {device}), a latent of 256 or 512 and a "
            f"RoPE part of 32 or 64 (this model: {kv_pool.kv_lora_rank} and {rope}), and a page "
            f"size of 1 or a multiple of 64 (here {kv_pool.page_size})"
        )
    if backend != "triton":
        return f"{where} runs in the Triton attention backend, not {backend!r}"
    return None
