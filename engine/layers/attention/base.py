"""The attention backend interface and the per-layer attention module that dispatches to it."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.kernels.mla_preamble import PoolRow
from engine.mem_cache.kv_pool import KVPool


class AttentionLayer(nn.Module):
    """Attention over the KV pool for one layer (SGLang's RadixAttention).

    Shapes: q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim], v [T, num_kv_heads,
    v_head_dim] or None (MLA: the value is part of the stored latent row). Returns
    [T, num_heads, v_head_dim]. For MLA's absorbed path num_kv_heads is 1, head_dim is
    kv_lora_rank + rope and v_head_dim is kv_lora_rank.
    """

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        scaling: float,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        self.scaling = scaling

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        fb: ForwardBatch,
        stored: bool = False,
        value_proj: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the new tokens' k (and v) at `fb.out_cache_loc` (unless `stored`: the caller
        wrote them, through `backend.mla_store_target`), then attend. `value_proj` (decode
        only): see `AttentionBackend.forward_decode`."""
        if not fb.attn_backend.traceable and torch.compiler.is_compiling():
            return _attend_untraced(self, q, k, v, fb, stored, value_proj)
        return self.attend(q, k, v, fb, stored, value_proj)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        fb: ForwardBatch,
        stored: bool = False,
        value_proj: torch.Tensor | None = None,
    ) -> torch.Tensor:
        backend = fb.attn_backend
        if not stored:
            backend.store_kv(self.layer_id, fb, k, v)
        if fb.is_decode:
            return backend.forward_decode(q, self, fb, value_proj)
        assert value_proj is None, "value_proj is a decode-only option"
        return backend.forward_extend(q, k, v, self, fb)


@torch.compiler.disable
def _attend_untraced(
    layer: AttentionLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    fb: ForwardBatch,
    stored: bool,
    value_proj: torch.Tensor | None,
) -> torch.Tensor:
    """A backend torch.compile cannot trace runs eagerly between the compiled pieces."""
    return layer.attend(q, k, v, fb, stored, value_proj)


class AttentionBackend(ABC):
    """Contract shared by the torch-native (reference) and Triton backends.

    - `init_forward_metadata(fb)` runs once per batch before the layers and sets
      `fb.attn_metadata` to an object of the backend's own metadata type.
    - `store_kv(layer_id, fb, k, v)` writes the new tokens' KV rows at `fb.out_cache_loc`
      (quantizing for an FP8 pool). Prefill and decode both store through it, unless
      `mla_store_target(layer_id, fb)` gives MLA's preamble kernel the pool rows to write
      itself (a `PoolRow`; None, the default: the backend stores).
    - `forward_extend` / `forward_decode` attend each request's new queries to its whole
      context, read from the pool through `req_to_token` after `store_kv` (causal: query i of a
      request sees context positions <= prefix + i). Extend also gets the new tokens' k and v,
      which a kernel may read directly instead of from the pool.
    - `forward_extend_ragged`: attention where k and v are given for each request's whole
      context (prefix + new tokens, concatenated request by request in batch order), not read
      from the pool. MLA's decompressing prefill uses it after up-projecting the cached latents,
      with the RoPE part of the heads given apart (`rope=(q_pe [T, H, R], k_pe [S, 1, R])`, k_pe
      one row for every head; q and k then hold the other dims): the scores are q.k + q_pe.k_pe.
    - `gather_context(layer_id, fb)`: the pool rows of every request's whole context, concatenated
      in batch order ([sum(seq_lens), kv_heads, dim] key and value).
    - CUDA graphs (backends with `supports_cuda_graph`): `init_cuda_graph_state(max_bs)` once
      before capture; `init_forward_metadata_capture(fb, max_seq_len)` sets the metadata of a
      decode batch over the graph's static buffers, valid for every batch of up to `max_seq_len`
      tokens of context; `init_forward_metadata_replay(fb, max_seq_len)` refreshes what the
      backend keeps outside those buffers before a replay. Neither may sync with the host.
    - `traceable`: torch.compile may trace `store_kv` and `forward_decode` (their kernels are
      custom ops and they read no per-batch host state). A compiled forward over another
      backend runs its attention eagerly, breaking the compiled graph around it.
    """

    supports_cuda_graph = False
    traceable = False

    def __init__(self, kv_pool: KVPool) -> None:
        self.kv_pool = kv_pool

    @abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    def store_kv(
        self, layer_id: int, fb: ForwardBatch, k: torch.Tensor, v: torch.Tensor | None
    ) -> None:
        self.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)

    def mla_store_target(self, layer_id: int, fb: ForwardBatch) -> PoolRow | None:
        return None

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        fb: ForwardBatch,
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        layer: AttentionLayer,
        fb: ForwardBatch,
        value_proj: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, H, v_head_dim]; with `value_proj` [H, v_head_dim, V] (MLA's W_UV, absorbed
        decode) the output times it per head, [T, H, V]: a backend may fuse the two."""

    @abstractmethod
    def forward_extend_ragged(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        fb: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...

    @abstractmethod
    def gather_context(
        self, layer_id: int, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture(self, fb: ForwardBatch, max_seq_len: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay(self, fb: ForwardBatch, max_seq_len: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
