"""Tensor parallelism: the rank's process group (`ParallelState`), how tensors are split
(`sharding`), and the worker processes that run ranks 1..N-1 (`workers`)."""

from __future__ import annotations

from engine.distributed.parallel_state import ParallelState, init_parallel_state
from engine.distributed.sharding import ShardSpec, shard_range

__all__ = ["ParallelState", "ShardSpec", "init_parallel_state", "shard_range"]
