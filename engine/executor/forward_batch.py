"""Per-batch inputs. `ScheduledBatch` is what the scheduler builds (plain ints, no tensors);
`ForwardBatch` is the same batch as device tensors, built by the model runner and passed explicitly
to every layer (no module-level state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.layers.attention.base import AttentionBackend
    from engine.mem_cache.kv_pool import KVPool


class ForwardMode(Enum):
    EXTEND = "extend"  # prefill, or a chunk of it, possibly after a cached prefix
    DECODE = "decode"  # one new token per request


@dataclass
class BatchEntry:
    """One request's share of a forward pass.

    NOTE: `prefix_slots`, when given, are written into the request's req_to_token row before the
    forward (the first chunk of a request that matched a cached prefix, or a request resumed after
    retraction). Later chunks and decode steps only write their `out_cache_loc`.
    """

    req_pool_idx: int
    input_ids: list[int]
    prefix_len: int  # tokens of this request already in the KV cache
    out_cache_loc: list[int]  # one slot per input token
    prefix_slots: list[int] | None = None


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    entries: list[BatchEntry]

    @property
    def batch_size(self) -> int:
        return len(self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(len(e.input_ids) for e in self.entries)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: slot of each new token
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64: prefix + new tokens
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]  # new tokens per request (1 for decode)
    req_to_token: torch.Tensor  # [max_reqs, max_context_len] int32
    kv_pool: KVPool
    attn_backend: AttentionBackend
    # Filled by the attention backend's init_forward_metadata.
    attn_metadata: dict[str, object] = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        return self.mode == ForwardMode.DECODE

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
