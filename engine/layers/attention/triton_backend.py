"""The GPU attention backend: Triton kernels from engine/kernels/.

Decode runs the split-KV kernels (grouped MLA decode over the latent pool, GQA decode over the
MHA pool) and stores new KV rows with the store kernel (quantizing for FP8). Extend runs the Triton
extend kernel for GQA over a bf16/fp16/fp32 pool, and its ragged form for MLA's decompressing
prefill (attention over the up-projected latents of each request's context). What has no kernel
yet falls back to the torch-native backend it derives from: extend over an FP8 MHA pool, and MLA
extend through the absorbed path.
"""

from __future__ import annotations

import torch

from engine.executor.forward_batch import ForwardBatch
from engine.kernels.extend import extend_attention, ragged_attention
from engine.kernels.gqa_decode import gqa_decode
from engine.kernels.kv_store import store_kv, store_mla_kv
from engine.kernels.mla_decode import mla_decode
from engine.layers.attention.base import AttentionLayer
from engine.layers.attention.torch_native import TorchNativeBackend
from engine.mem_cache.kv_pool import FP8_DTYPE, KVPool, MHATokenToKVPool, MLATokenToKVPool


class TritonBackend(TorchNativeBackend):
    def __init__(self, kv_pool: KVPool) -> None:
        self.kv_pool = kv_pool
        self.is_mla = isinstance(kv_pool, MLATokenToKVPool)
        self.is_fp8 = kv_pool.store_dtype == FP8_DTYPE
        device = _pool_device(kv_pool)
        # The kernels take FP8 scales as [1] float32 tensors; the pools keep them as floats.
        self.k_scales = [_scale(s, device) for s in kv_pool.k_scale]
        v_scales = getattr(kv_pool, "v_scale", kv_pool.k_scale)
        self.v_scales = [_scale(s, device) for s in v_scales]

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        meta = fb.attn_metadata
        meta["max_seq_len"] = max(fb.seq_lens_cpu)
        if fb.is_decode:
            return
        if self.is_fp8 and not self.is_mla:
            super().init_forward_metadata(fb)  # extend over an FP8 MHA pool is torch-native
            return
        extend_lens = torch.tensor(fb.extend_lens_cpu, device=fb.seq_lens.device)
        meta["prefix_lens"] = torch.tensor(fb.prefix_lens_cpu, device=fb.seq_lens.device)
        meta["extend_start_loc"] = torch.cumsum(extend_lens, 0) - extend_lens
        meta["max_extend_len"] = max(fb.extend_lens_cpu)
        if self.is_mla:
            super().init_forward_metadata(fb)  # the context slots, for gather_context
            meta["context_start_loc"] = torch.cumsum(fb.seq_lens, 0) - fb.seq_lens

    def _store(self, layer: AttentionLayer, fb: ForwardBatch, k: torch.Tensor, v) -> None:
        lid = layer.layer_id
        scale = self.k_scales[lid] if self.is_fp8 else None
        if isinstance(self.kv_pool, MLATokenToKVPool):
            store_mla_kv(self.kv_pool.kv_buffer[lid], fb.out_cache_loc, k, scale)
        else:
            assert isinstance(self.kv_pool, MHATokenToKVPool) and v is not None
            v_scale = self.v_scales[lid] if self.is_fp8 else None
            pool = self.kv_pool
            store_kv(pool.k_buffer[lid], pool.v_buffer[lid], fb.out_cache_loc, k, v, scale, v_scale)

    def forward_decode(self, q, k, v, layer, fb, save_kv=True):
        lid = layer.layer_id
        if save_kv and k is not None:
            self._store(layer, fb, k, v)
        scale = self.k_scales[lid] if self.is_fp8 else None
        max_seq_len = fb.attn_metadata["max_seq_len"]
        if isinstance(self.kv_pool, MLATokenToKVPool):
            return mla_decode(
                q,
                self.kv_pool.kv_buffer[lid],
                fb.req_to_token,
                fb.req_pool_indices,
                fb.seq_lens,
                layer.v_head_dim,
                layer.scaling,
                k_scale=scale,
                max_seq_len=max_seq_len,  # type: ignore[arg-type]
                page_size=self.kv_pool.page_size,
            )
        assert isinstance(self.kv_pool, MHATokenToKVPool)
        return gqa_decode(
            q,
            self.kv_pool.k_buffer[lid],
            self.kv_pool.v_buffer[lid],
            fb.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            layer.scaling,
            k_scale=scale,
            v_scale=self.v_scales[lid] if self.is_fp8 else None,
            max_seq_len=max_seq_len,  # type: ignore[arg-type]
        )

    def forward_extend_ragged(self, q, k, v, layer, fb):
        meta = fb.attn_metadata
        return ragged_attention(
            q,
            k,
            v,
            fb.seq_lens,
            meta["prefix_lens"],  # type: ignore[arg-type]
            meta["extend_start_loc"],  # type: ignore[arg-type]
            meta["context_start_loc"],  # type: ignore[arg-type]
            layer.scaling,
            max_extend_len=meta["max_extend_len"],  # type: ignore[arg-type]
        )

    def forward_extend(self, q, k, v, layer, fb, save_kv=True):
        if self.is_mla or self.is_fp8 or k is None or v is None:
            if save_kv and k is not None:
                self._store(layer, fb, k, v)
            return super().forward_extend(q, k, v, layer, fb, save_kv=False)
        if save_kv:
            self._store(layer, fb, k, v)
        assert isinstance(self.kv_pool, MHATokenToKVPool)
        meta = fb.attn_metadata
        return extend_attention(
            q,
            k,
            v,
            self.kv_pool.k_buffer[layer.layer_id],
            self.kv_pool.v_buffer[layer.layer_id],
            fb.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            meta["prefix_lens"],  # type: ignore[arg-type]
            meta["extend_start_loc"],  # type: ignore[arg-type]
            layer.scaling,
            max_extend_len=meta["max_extend_len"],  # type: ignore[arg-type]
        )


def _pool_device(pool: KVPool) -> torch.device:
    if isinstance(pool, MLATokenToKVPool):
        return pool.kv_buffer[0].device
    assert isinstance(pool, MHATokenToKVPool)
    return pool.k_buffer[0].device


def _scale(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=device)
