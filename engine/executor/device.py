"""Which device and dtype a rank runs on."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel `rank`: on CUDA the rank-th GPU from the configured one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if rank and index >= torch.cuda.device_count():
        raise RuntimeError(
            f"tensor-parallel rank {rank} needs GPU {index}; {torch.cuda.device_count()} visible"
        )
    return torch.device("cuda", index) if rank or device.index is not None else device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]
