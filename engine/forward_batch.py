"""`ForwardBatch`: one scheduled batch as device tensors, passed explicitly to every layer (no
module-level state). The model runner builds it (`ForwardBatch.build`, for eager batches and for
the static buffers of captured CUDA graphs alike); models, layers and attention backends read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.scheduler.batch import ForwardMode

if TYPE_CHECKING:  # type-only: these modules import ForwardBatch at run time, not the reverse
    from engine.layers.attention.base import AttentionBackend
    from engine.mem_cache.kv_pool import KVPool


@dataclass(frozen=True)
class ForwardContext:
    """The runner's long-lived state that every batch points at."""

    req_to_token: torch.Tensor  # [max_reqs, max_context_len] int32
    kv_pool: KVPool
    attn_backend: AttentionBackend


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: slot of each new token
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64: prefix + new tokens
    extend_lens: torch.Tensor  # [B] int64: new tokens per request (1 for decode)
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token: torch.Tensor
    kv_pool: KVPool
    attn_backend: AttentionBackend
    # Set by the attention backend (init_forward_metadata or its CUDA-graph hooks): an object
    # of that backend's own metadata type.
    attn_metadata: Any = None

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        ctx: ForwardContext,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        seq_lens_cpu: list[int],
        prefix_lens_cpu: list[int],
        extend_lens_cpu: list[int],
    ) -> ForwardBatch:
        return cls(
            mode=mode,
            batch_size=len(seq_lens_cpu),
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            seq_lens_cpu=seq_lens_cpu,
            prefix_lens_cpu=prefix_lens_cpu,
            extend_lens_cpu=extend_lens_cpu,
            req_to_token=ctx.req_to_token,
            kv_pool=ctx.kv_pool,
            attn_backend=ctx.attn_backend,
        )

    @property
    def is_decode(self) -> bool:
        return self.mode == ForwardMode.DECODE

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
