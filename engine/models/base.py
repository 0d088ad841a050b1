"""What every model offers the runner and the loader."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: `param[index]` (index None: the whole parameter)."""

    param: torch.Tensor
    index: tuple[int | slice, ...] | None = None

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
    """Checkpoint names equal to parameter names (the common case), minus `skip` substrings."""
    targets: dict[str, WeightTarget] = {}
    for name, param in module.named_parameters():
        if not any(s in name for s in skip):
            targets[name] = WeightTarget(param.data)
    return targets
