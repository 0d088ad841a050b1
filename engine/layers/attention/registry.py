"""Attention backends by name."""

from __future__ import annotations

import torch

from engine.config import ATTENTION_BACKENDS, ConfigError
from engine.layers.attention.base import AttentionBackend
from engine.mem_cache.kv_pool import KVPool, MLATokenToKVPool


def make_attention_backend(
    name: str,
    kv_pool: KVPool,
    device: torch.device,
    mla_decode_kernel: str = "auto",
    num_heads: int = 0,
) -> AttentionBackend:
    """ "auto": Triton kernels on CUDA, the torch-native reference elsewhere.
    `mla_decode_kernel` (`EngineConfig.mla_decode_kernel`) "gluon" is checked against the pool,
    the query heads a GPU (`num_heads`) and the GPU here, so that a setting that cannot run is
    refused at start; "auto" takes the Gluon kernels wherever that check passes."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch_native"
    refusal = _gluon_decode_refusal(name, kv_pool, device, num_heads)
    if mla_decode_kernel == "gluon" and refusal:
        raise ConfigError(refusal)
    gluon = mla_decode_kernel in ("gluon", "auto") and refusal is None
    if name == "triton":
        from engine.layers.attention.triton_backend import TritonBackend

        return TritonBackend(kv_pool, gluon_decode=gluon)
    from engine.layers.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(kv_pool)


def _gluon_decode_refusal(
    backend: str, kv_pool: KVPool, device: torch.device, num_heads: int
) -> str | None:
    """Why the Gluon MLA decode kernels cannot run here, or None: they need the Triton backend,
    an MLA model's latent pool of fp8, bf16 or fp16, a Hopper GPU and shapes they serve
    (`mla_decode_gluon.fits`; a 16-bit pool at 64+ heads takes `mla_decode_gluon_wide`, which
    needs a latent of 512)."""
    where = "mla_decode_kernel='gluon'"
    if not isinstance(kv_pool, MLATokenToKVPool):
        return f"{where} applies to MLA models (DeepSeek-V2/V3)"
    from engine.kernels import mla_decode_gluon, mla_decode_gluon_wide

    rank, rope, page = kv_pool.kv_lora_rank, kv_pool.qk_rope_head_dim, kv_pool.page_size
    sizes = (
        f"(this model: {rank} and {rope}), and a page size of 1 or a multiple of 64 (here {page})"
    )
    wide = not kv_pool.is_fp8 and mla_decode_gluon_wide.serves_shape(num_heads, rank, rope)
    if wide and not mla_decode_gluon_wide.fits(device, num_heads, rank, rope, page):
        return (
            f"{where} over a 16-bit cache at 64+ query heads needs a Hopper GPU (sm_90; this is "
            f"{device}), a latent of 512 and a RoPE part of 32 or 64 {sizes}"
        )
    if not wide and not mla_decode_gluon.fits(device, rank, rope, page):
        return (
            f"{where} needs a Hopper GPU (sm_90; this is {device}), a latent of 256 or 512 and a "
            f"RoPE part of 32 or 64 {sizes}"
        )
    if kv_pool.store_dtype not in (torch.bfloat16, torch.float16) and not kv_pool.is_fp8:
        return f"{where} needs a bf16, fp16 or fp8 cache, not {kv_pool.store_dtype}"
    if backend != "triton":
        return f"{where} runs in the Triton attention backend, not {backend!r}"
    return None
