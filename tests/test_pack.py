"""ModelRunner's packed host-to-device copy of a step's integer inputs."""

from __future__ import annotations

import random

import torch

from engine.executor.model_runner import pack_int64


def test_every_field_is_16_byte_aligned_and_intact() -> None:
    rng = random.Random(0)
    for _ in range(50):
        fields = [[rng.randrange(-5, 10**6) for _ in range(rng.randrange(0, 9))] for _ in range(9)]
        parts = pack_int64(fields, torch.device("cpu"))
        assert [p.tolist() for p in parts] == fields
        base = parts[0].untyped_storage().data_ptr()
        assert len({p.untyped_storage().data_ptr() for p in parts}) == 1  # one copy
        # offsets in that storage: 16-byte multiples whatever the lengths before
        assert all((p.data_ptr() - base) % 16 == 0 for p in parts)
        assert all(p.dtype == torch.int64 for p in parts)
