"""The scheduler's description of one forward pass: plain ints, no tensors.

The model runner turns a `ScheduledBatch` into a `ForwardBatch` (engine/forward_batch.py) of
device tensors; tensor-parallel workers receive the `ScheduledBatch` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


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
