"""The GPU attention backend: Triton kernels from engine/kernels/.

Decode runs the split-KV kernels (grouped MLA decode over the latent pool, GQA decode over the
MHA pool); new KV rows go in through the store kernel (quantizing for FP8), at prefill and decode
alike. Extend runs the Triton extend kernel for GQA over a bf16/fp16/fp32 pool, and its ragged
form for MLA's decompressing prefill (attention over the up-projected latents of each request's
context). What has no kernel yet goes to a torch-native backend held beside it: extend over an
FP8 MHA pool, MLA extend through the absorbed path (a test option), and gathering the context
rows MLA's prefill up-projects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.kernels.custom_ops_attention import gqa_decode, mla_decode, store_kv, store_mla_kv
from engine.kernels.extend import extend_attention, ragged_attention
from engine.kernels.mla_preamble import PoolRow
from engine.layers.attention.base import AttentionBackend
from engine.layers.attention.torch_native import TorchNativeBackend, TorchNativeMetadata
from engine.mem_cache.kv_pool import KVPool, MHATokenToKVPool, MLATokenToKVPool


@dataclass
class TritonMetadata:
    # The kernels size their split-KV count from this: the longest context in the batch, or the
    # longest a captured graph may replay.
    max_seq_len: int
    # Extend only.
    prefix_lens: torch.Tensor | None = None  # [B]
    extend_start_loc: torch.Tensor | None = None  # [B]: first new token of each request
    context_start_loc: torch.Tensor | None = None  # [B]: MLA prefill's ragged context rows
    max_extend_len: int = 0
    native: TorchNativeMetadata | None = None  # for the paths that run torch-native


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True
    traceable = True  # decode and the KV store are custom ops (engine/kernels/custom_ops.py)

    def __init__(self, kv_pool: KVPool, gluon_decode: bool = False) -> None:
        super().__init__(kv_pool)
        self.is_mla = isinstance(kv_pool, MLATokenToKVPool)
        self.native = TorchNativeBackend(kv_pool)
        # MLA decode through the Gluon kernels (EngineConfig.mla_decode_kernel, checked by
        # `make_attention_backend`).
        self.gluon_decode = gluon_decode

    # ---- metadata -----------------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        meta = TritonMetadata(max_seq_len=max(fb.seq_lens_cpu))
        fb.attn_metadata = meta
        if fb.is_decode:
            return
        if self.kv_pool.is_fp8 and not self.is_mla:
            meta.native = self.native.build_metadata(fb)  # extend over FP8 MHA: torch-native
            return
        meta.prefix_lens = fb.seq_lens - fb.extend_lens
        meta.extend_start_loc = torch.cumsum(fb.extend_lens, 0) - fb.extend_lens
        meta.max_extend_len = max(fb.extend_lens_cpu)
        if self.is_mla:
            meta.native = self.native.build_metadata(fb)  # the context slots, for gather_context
            meta.context_start_loc = torch.cumsum(fb.seq_lens, 0) - fb.seq_lens

    def init_cuda_graph_state(self, max_bs: int) -> None:
        pass  # the kernels keep no per-batch state outside ForwardBatch's buffers

    def init_forward_metadata_capture(self, fb: ForwardBatch, max_seq_len: int) -> None:
        assert fb.is_decode
        fb.attn_metadata = TritonMetadata(max_seq_len=max_seq_len)

    def init_forward_metadata_replay(self, fb: ForwardBatch, max_seq_len: int) -> None:
        pass  # the captured metadata holds for every replay up to max_seq_len

    # ---- KV store -----------------------------------------------------------------------------
    def store_kv(self, layer_id, fb, k, v):
        pool = self.kv_pool
        scale = pool.k_scale[layer_id] if pool.is_fp8 else None
        if isinstance(pool, MLATokenToKVPool):
            store_mla_kv(pool.kv_buffer[layer_id], fb.out_cache_loc, k, scale)
            return
        assert isinstance(pool, MHATokenToKVPool) and v is not None
        v_scale = pool.v_scale[layer_id] if pool.is_fp8 else None
        kb, vb = pool.k_buffer[layer_id], pool.v_buffer[layer_id]
        store_kv(kb, vb, fb.out_cache_loc, k, v, scale, v_scale)

    def mla_store_target(self, layer_id: int, fb: ForwardBatch) -> PoolRow | None:
        """The latent pool's rows of this layer, for MLA's preamble kernel to store into."""
        pool = self.kv_pool
        if not isinstance(pool, MLATokenToKVPool):
            return None
        buffer = pool.kv_buffer[layer_id]
        scale = pool.k_scale[layer_id] if pool.is_fp8 else None
        return PoolRow(buffer.view(buffer.shape[0], -1), fb.out_cache_loc, scale)

    # ---- attention ----------------------------------------------------------------------------
    def forward_decode(self, q, layer, fb, value_proj=None):
        lid, pool = layer.layer_id, self.kv_pool
        meta: TritonMetadata = fb.attn_metadata
        scale = pool.k_scale[lid] if pool.is_fp8 else None
        if isinstance(pool, MLATokenToKVPool):
            return mla_decode(
                q,
                pool.kv_buffer[lid],
                fb.req_to_token,
                fb.req_pool_indices,
                fb.seq_lens,
                layer.v_head_dim,
                layer.scaling,
                k_scale=scale,
                max_seq_len=meta.max_seq_len,
                page_size=pool.page_size,
                value_proj=value_proj,
                gluon=self.gluon_decode,
            )
        assert isinstance(pool, MHATokenToKVPool) and value_proj is None
        return gqa_decode(
            q,
            pool.k_buffer[lid],
            pool.v_buffer[lid],
            fb.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            layer.scaling,
            k_scale=scale,
            v_scale=pool.v_scale[lid] if pool.is_fp8 else None,
            max_seq_len=meta.max_seq_len,
        )

    def forward_extend(self, q, k, v, layer, fb):
        meta: TritonMetadata = fb.attn_metadata
        pool = self.kv_pool
        if self.is_mla or pool.is_fp8 or v is None:
            assert meta.native is not None
            return self.native.extend_from_pool(q, layer, fb, meta.native)
        assert isinstance(pool, MHATokenToKVPool)
        assert meta.prefix_lens is not None and meta.extend_start_loc is not None
        return extend_attention(
            q,
            k,
            v,
            pool.k_buffer[layer.layer_id],
            pool.v_buffer[layer.layer_id],
            fb.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            meta.prefix_lens,
            meta.extend_start_loc,
            layer.scaling,
            max_extend_len=meta.max_extend_len,
        )

    def forward_extend_ragged(self, q, k, v, layer, fb, rope=None):
        meta: TritonMetadata = fb.attn_metadata
        assert meta.prefix_lens is not None and meta.extend_start_loc is not None
        assert meta.context_start_loc is not None
        return ragged_attention(
            q,
            k,
            v,
            fb.seq_lens,
            meta.prefix_lens,
            meta.extend_start_loc,
            meta.context_start_loc,
            layer.scaling,
            max_extend_len=meta.max_extend_len,
            q_pe=None if rope is None else rope[0],
            k_pe=None if rope is None else rope[1],
        )

    def gather_context(self, layer_id, fb):
        meta: TritonMetadata = fb.attn_metadata
        assert meta.native is not None
        return self.native.gather_from(layer_id, meta.native)
