"""The tensor-parallel collectives as torch custom ops, for torch.compile.

Dynamo cannot trace a call into a c10d process group (a pybind object), so a compiled forward
would break its graph at every all-reduce, and a `fullgraph` compile (the Triton backend's)
would fail. As custom ops with fake implementations the collectives are opaque nodes of one
graph. `ParallelState` calls them only while dynamo traces; eager steps call the group directly.

A custom op's arguments are tensors and plain values, so an op finds its group by a name that
`register_group` hands out (torch's functional collectives name their groups the same way). The
names are per process: each rank registers its own group.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

# NOTE: the one piece of module-level state: process groups by name, added when a rank joins a
# group and removed when it closes it (ParallelState.close).
_GROUPS: dict[str, Any] = {}
_NEXT = itertools.count()


def register_group(group: Any) -> str:
    """A name under which the ops below find `group`."""
    name = f"tp{next(_NEXT)}"
    _GROUPS[name] = group
    return name


def unregister_group(name: str) -> None:
    _GROUPS.pop(name, None)


@torch.library.custom_op("engine::tp_all_reduce", mutates_args=("x",))
def tp_all_reduce(x: Tensor, group_name: str) -> None:
    """Sum `x` over the group, in place."""
    _GROUPS[group_name].allreduce([x]).wait()


@tp_all_reduce.register_fake
def _(x: Tensor, group_name: str) -> None:
    return None


@torch.library.custom_op("engine::tp_all_gather", mutates_args=())
def tp_all_gather(x: Tensor, group_name: str, world_size: int) -> Tensor:
    """Every rank's `x` (all of one shape), stacked: [world_size, *x.shape]."""
    parts = [torch.empty_like(x) for _ in range(world_size)]
    _GROUPS[group_name].allgather([parts], [x.contiguous()]).wait()
    return torch.stack(parts)


@tp_all_gather.register_fake
def _(x: Tensor, group_name: str, world_size: int) -> Tensor:
    return x.new_empty((world_size, *x.shape))
