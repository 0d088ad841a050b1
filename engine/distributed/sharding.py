"""How a dimension is split across tensor-parallel ranks, and which slice of a checkpoint tensor a
rank loads.

Splits are contiguous and may be uneven: with `total` units over `world_size` ranks the first
`total % world_size` ranks get one unit more. Units are what must not be cut (a KV-head group of
query heads, one head of kv_b_proj, one row of the vocabulary), so 9 query heads in 3 KV groups
split over 2 ranks as 6 + 3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def shard_range(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, size) of `rank`'s contiguous share of `total` units."""
    base, extra = divmod(total, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class ShardSpec:
    """This rank holds `size` entries from `start` along `dim` of a tensor whose full extent
    along `dim` is `full`; every other dimension is whole."""

    dim: int
    start: int
    size: int
    full: int

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint tensor's shape, given this rank's shape."""
        shape = list(local_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def select(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a view)."""
        return tensor.narrow(self.dim, self.start, self.size)

    def index(self, ndim: int) -> tuple[slice, ...]:
        """The slice as an index, for lazy readers (safetensors' get_slice)."""
        idx = [slice(None)] * ndim
        idx[self.dim] = slice(self.start, self.start + self.size)
        return tuple(idx)
