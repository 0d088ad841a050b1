"""What every model offers the runner and the loader."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed.sharding import ShardSpec
from engine.executor.forward_batch import ForwardBatch
from engine.layers.linear import ShardedModule


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: `param[index]` (index None: the whole parameter).

    `shard`, under tensor parallelism: only this slice of the checkpoint tensor is loaded (the
    checkpoint holds the full tensor; the destination holds this rank's part).
    """

    param: torch.Tensor
    index: tuple[int | slice, ...] | None = None
    shard: ShardSpec | None = None

    def view(self) -> torch.Tensor:
        return self.param if self.index is None else self.param[self.index]


class CausalLM(nn.Module):
    """A decoder-only model over the KV pool.

    `forward` returns the final hidden states [T, hidden] of every input token; the runner picks
    rows and calls `compute_logits`. `weight_targets` maps every checkpoint tensor name the model
    needs to its destination; the loader fails on names that are missing or unexpected.
    """

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_targets(self) -> dict[str, WeightTarget]:
        raise NotImplementedError

    def tied_weights(self) -> dict[str, str]:
        """Checkpoint names that are aliases of another (a tied LM head and embedding): either
        name may be stored, and one of the two must be."""
        return {}

    def post_load(self) -> None:
        """Derive weights after loading (MLA's absorbed projections, tied heads)."""


def default_targets(module: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, WeightTarget]:
    """Checkpoint names equal to parameter names (the common case), minus `skip` substrings.
    Parameters of sharded modules (parallel linears) carry their module's shard spec."""
    shards: dict[str, ShardSpec] = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, ShardedModule):
            for pname, spec in sub.shard_specs().items():
                shards[f"{prefix}.{pname}" if prefix else pname] = spec
    targets: dict[str, WeightTarget] = {}
    for name, param in module.named_parameters():
        if not any(s in name for s in skip):
            targets[name] = WeightTarget(param.data, shard=shards.get(name))
    return targets
