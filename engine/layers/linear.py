"""Tensor-parallel linear layers and the vocabulary-parallel embedding and LM head.

Each keeps only its rank's slice of the weight, named `weight` (and `bias`) as in the checkpoint;
`shard_specs()` tells the loader which slice of the full checkpoint tensor that is. With one rank
each layer computes exactly what nn.Linear / nn.Embedding would (same ops, no communication).

- ColumnParallelLinear: output features split; no communication (q/k/v, gate/up, kv_b_proj).
- RowParallelLinear: input features split; partial outputs summed with an all-reduce
  (o_proj, down_proj), or left partial (`reduce_results=False`) for the caller to reduce once.
- VocabParallelEmbedding: vocabulary rows split; ids outside the rank's rows give zeros, and an
  all-reduce assembles the embeddings.
- ParallelLMHead: vocabulary rows split; the logits are all-gathered so rank 0 can sample.

Splits are in whole `unit`s (a head's worth of features) and may be uneven (sharding.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import ParallelState
from engine.distributed.sharding import ShardSpec, shard_range
from engine.kernels.gemv import gemv, gemv_wanted


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: str = "auto"
) -> torch.Tensor:
    """F.linear, with a batch-1 decode step's one row on the GEMV kernel where cuBLAS leaves
    SMs idle (`engine.kernels.gemv`). `kernel`: "auto", "triton" (forced, for tests) or
    "native"."""
    if gemv_wanted(x, weight, kernel):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class ShardedModule(nn.Module):
    """A module whose parameters are slices of bigger checkpoint tensors."""

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Parameter name (local to this module) -> the slice of the checkpoint tensor it holds;
        parameters not named are whole (replicated)."""
        return {}


def _units(features: int, unit: int, what: str) -> int:
    if features % unit:
        raise ValueError(f"{what}: {features} features are not whole units of {unit}")
    return features // unit


class ColumnParallelLinear(ShardedModule):
    """y = x W^T + b for this rank's slice of the output features."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelState,
        bias: bool = False,
        unit: int = 1,
        what: str = "output features",
    ) -> None:
        super().__init__()
        start, size = parallel.shard(_units(out_features, unit, what), what)
        self.spec = ShardSpec(0, start * unit, size * unit, out_features)
        self.in_features = in_features
        self.out_features = size * unit  # this rank's
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias: nn.Parameter | None
        self.register_parameter(
            "bias", nn.Parameter(torch.empty(self.out_features)) if bias else None
        )
        self.kernel = "auto"  # see `linear`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernel)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec, "bias": self.spec}


class RowParallelLinear(ShardedModule):
    """y = sum over ranks of x_r W_r^T, plus b (added once): x arrives split by features."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelState,
        bias: bool = False,
        unit: int = 1,
        reduce_results: bool = True,
        what: str = "input features",
    ) -> None:
        super().__init__()
        start, size = parallel.shard(_units(in_features, unit, what), what)
        self.parallel = parallel
        self.reduce_results = reduce_results
        self.spec = ShardSpec(1, start * unit, size * unit, in_features)
        self.in_features = size * unit  # this rank's
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features))
        self.bias: nn.Parameter | None
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features)) if bias else None)
        self.kernel = "auto"  # see `linear`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.parallel.enabled:
            return linear(x, self.weight, self.bias, self.kernel)
        # NOTE: the bias joins on rank 0 only, so the sum holds it once.
        y = linear(x, self.weight, self.bias if self.parallel.rank == 0 else None, self.kernel)
        return self.parallel.all_reduce(y) if self.reduce_results else y

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec}


class VocabParallelEmbedding(ShardedModule):
    """Token embeddings with the vocabulary rows split across ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState) -> None:
        super().__init__()
        start, size = parallel.shard(vocab_size, "vocabulary rows")
        self.parallel = parallel
        self.spec = ShardSpec(0, start, size, vocab_size)
        self.weight = nn.Parameter(torch.empty(size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.enabled:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.spec.start
        outside = (local < 0) | (local >= self.spec.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(out)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec}


class ParallelLMHead(ShardedModule):
    """hidden -> logits over the whole vocabulary; each rank computes its rows, then all-gather.

    Shares its split with VocabParallelEmbedding, so a tied head can reuse the embedding's shard.
    """

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState) -> None:
        super().__init__()
        start, size = parallel.shard(vocab_size, "vocabulary rows")
        self.parallel = parallel
        self.spec = ShardSpec(0, start, size, vocab_size)
        world = parallel.world_size
        self.sizes = [shard_range(vocab_size, world, r)[1] for r in range(world)]
        self.weight = nn.Parameter(torch.empty(size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        return self.parallel.all_gather(logits, self.sizes)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec}
