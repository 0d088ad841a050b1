"""The attention backend interface and the per-layer attention module that dispatches to it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.executor.forward_batch import ForwardBatch


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
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        fb: ForwardBatch,
        save_kv: bool = True,
    ) -> torch.Tensor:
        if fb.is_decode:
            return fb.attn_backend.forward_decode(q, k, v, self, fb, save_kv)
        return fb.attn_backend.forward_extend(q, k, v, self, fb, save_kv)


class AttentionBackend:
    """Contract shared by the torch-native (reference) and Triton backends.

    - `init_forward_metadata(fb)` runs once per batch before the layers; it may precompute index
      tensors into `fb.attn_metadata`.
    - `forward_extend` / `forward_decode`: when `save_kv`, store k (and v) at `fb.out_cache_loc`
      first, then attend each request's new queries to its whole context read from the pool
      through `req_to_token` (causal: query i of a request sees context positions <= prefix + i).
    - `forward_extend_ragged`: attention where k and v are given for each request's whole context
      (prefix + new tokens, concatenated request by request in batch order), not read from the
      pool. MLA's decompressing prefill uses it after up-projecting the cached latents.
    - `gather_context(layer_id, fb)`: the pool rows of every request's whole context, concatenated
      in batch order ([sum(seq_lens), kv_heads, dim] key and value).
    """

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        raise NotImplementedError

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        fb: ForwardBatch,
        save_kv: bool = True,
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        fb: ForwardBatch,
        save_kv: bool = True,
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward_extend_ragged(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        raise NotImplementedError

    def gather_context(self, layer_id: int, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError
