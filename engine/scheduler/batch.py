"""The scheduler's description of one forward pass: plain ints, no tensors.

The model runner turns a `ScheduledBatch` into a `ForwardBatch` (engine/forward_batch.py) of
device tensors; tensor-parallel workers receive the `ScheduledBatch` itself.
"""

from __future__ import annotations

from array import array
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

    def to_bytes(self, all_logits: bool = False) -> bytes:
        """The batch as one flat int64 buffer (what rank 0 sends tensor-parallel workers each
        step: a few bytes per token, no per-request pickling). `from_bytes` reverses it."""
        buf = array("q", [_MODES.index(self.mode), int(all_logits), len(self.entries)])
        for e in self.entries:
            slots = -1 if e.prefix_slots is None else len(e.prefix_slots)
            buf.extend((e.req_pool_idx, e.prefix_len, len(e.input_ids), slots))
            buf.extend(e.input_ids)
            buf.extend(e.out_cache_loc)
            if e.prefix_slots is not None:
                buf.extend(e.prefix_slots)
        return buf.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> tuple[ScheduledBatch, bool]:
        """(batch, all_logits) from `to_bytes`."""
        buf = array("q")
        buf.frombytes(data)
        mode, all_logits, count = buf[0], bool(buf[1]), buf[2]
        entries, i = [], 3
        for _ in range(count):
            row, prefix_len, n, slots = buf[i : i + 4]
            i += 4
            input_ids, out_cache_loc = buf[i : i + n].tolist(), buf[i + n : i + 2 * n].tolist()
            i += 2 * n
            prefix_slots = None
            if slots >= 0:
                prefix_slots = buf[i : i + slots].tolist()
                i += slots
            entries.append(BatchEntry(row, input_ids, prefix_len, out_cache_loc, prefix_slots))
        return cls(_MODES[mode], entries), all_logits


_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE)
