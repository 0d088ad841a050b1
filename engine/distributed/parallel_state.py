"""One rank's tensor-parallel process group and the collectives the layers call.

The group is a c10d process group built directly on a TCPStore, not torch.distributed's default
(global) group: several engines can live in one process (tests build TP=1 and TP=2 engines side
by side), and the group is handed explicitly to every layer that needs it. With world_size 1 there
is no group and every collective is the identity, so TP=1 runs exactly the single-device code.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.config import ConfigError
from engine.distributed.comm_ops import (
    register_group,
    tp_all_gather,
    tp_all_reduce,
    unregister_group,
)
from engine.distributed.sharding import shard_range

# Collectives and the start-up rendezvous fail after this long (a rank died or hangs).
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


class CommGroup(Protocol):
    """The c10d process-group calls used here (ProcessGroupGloo and ProcessGroupNCCL offer them;
    each returns a Work to `.wait()` on)."""

    def allreduce(self, tensors: list[torch.Tensor], *opts: Any) -> Any: ...

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Any: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any: ...


@dataclass
class ParallelState:
    """`rank` of `world_size` in the tensor-parallel group `group` (None when world_size is 1).

    NOTE: every rank must call the collectives in the same order with tensors of the same shape;
    the ranks run the same batches through the same model, so the model's forward guarantees it.
    """

    rank: int = 0
    world_size: int = 1
    group: CommGroup | None = None
    # Rank 0 hosts the TCPStore server; it must outlive the group.
    store: dist.Store | None = field(default=None, repr=False)
    # The group's name for the custom ops that compiled code calls (engine/distributed/comm_ops.py).
    group_name: str = ""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's share of `total` units of `what` (for the error)."""
        if total < self.world_size:
            raise ConfigError(
                f"tp_size={self.world_size} cannot split the model's {total} {what} "
                f"(every rank needs at least one); use tp_size <= {total}"
            )
        return shard_range(total, self.world_size, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        if self.group is None:
            return x
        if torch.compiler.is_compiling():  # dynamo cannot trace into the group
            tp_all_reduce(x, self.group_name)
            return x
        self.group.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` on every rank, written into `x` (contiguous); returns `x`.

        On CUDA (NCCL) the wait only orders the current stream after the broadcast: the host
        does not wait for the device."""
        if self.group is None:
            return x
        assert x.is_contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.group.broadcast([x], opts).wait()
        return x

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim; rank r's holds `sizes[r]` columns.

        Uneven shares are padded to the widest for the collective and cut back after.
        """
        if self.group is None:
            return x
        width = max(sizes)
        if x.shape[-1] < width:
            x = F.pad(x, (0, width - x.shape[-1]))
        x = x.contiguous()
        if torch.compiler.is_compiling():
            parts = list(tp_all_gather(x, self.group_name, self.world_size).unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            self.group.allgather([parts], [x]).wait()
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the ranks (they must agree on e.g. the KV pool size)."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        self.group.allreduce([t], opts).wait()
        return int(t.item())

    def close(self) -> None:
        """Drop the group (its connections close when the last reference goes)."""
        unregister_group(self.group_name)
        self.group = None
        self.store = None


def init_parallel_state(
    rank: int,
    world_size: int,
    port: int,
    device: torch.device,
    store: dist.Store | None = None,
) -> ParallelState:
    """Join the group rendezvousing on 127.0.0.1:`port` (rank 0 passes the store it hosts).

    Blocks until every rank has joined. NCCL on CUDA (call torch.cuda.set_device first), gloo
    on CPU.
    """
    if world_size == 1:
        return ParallelState()
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, GROUP_TIMEOUT)
    prefixed = dist.PrefixStore("tp", store)
    group: Any
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = GROUP_TIMEOUT
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, GROUP_TIMEOUT)
    return ParallelState(rank, world_size, cast(CommGroup, group), store, register_group(group))


def host_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous server on a free port of 127.0.0.1 (`.port` tells which)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, True, GROUP_TIMEOUT, wait_for_workers=False)
