"""Load an HF safetensors checkpoint (one file or sharded) into a model, checking every name."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.models.base import CausalLM

# Tensors that checkpoints carry but the engine does not use.
_IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class CheckpointError(ValueError):
    """The checkpoint does not match the model: missing, unexpected or misshapen tensors."""


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read the checkpoint index {str(index)!r}: {e!r}") from e
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {str(path)!r}")
    return files


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) of every stored tensor: `.get_shape()` reads no data, and indexing
    (`s[:]`, `s[0:4, :]`) reads only what it selects, so each TP rank reads only its shard."""
    files = checkpoint_files(path)
    for file in tqdm(files, desc="loading weights", unit="file", disable=len(files) < 2):
        try:
            handle = safe_open(str(file), framework="pt")
        except FileNotFoundError:
            raise
        except Exception as e:  # SafetensorError: a truncated or corrupt file
            raise CheckpointError(f"cannot read {str(file)!r}: {e}") from e
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_slice(name)


def load_weights(model: CausalLM, path: str | Path, num_layers: int) -> None:
    """Copy every checkpoint tensor into its target, converting dtype on the way. A target with
    a shard spec gets only its slice of the tensor (tensor parallelism).

    Raises CheckpointError naming the first tensors that are unexpected, misshapen or missing.
    Layers at index >= num_layers (DeepSeek-V3's multi-token-prediction layer) are skipped.
    """
    targets = model.weight_targets()
    tied = model.tied_weights()
    for alias in tied:
        targets.pop(alias, None)
    seen: set[str] = set()
    unexpected: list[str] = []
    extra_layer = re.compile(r"^model\.layers\.(\d+)\.")
    with torch.no_grad():
        for stored_name, tensor in iter_checkpoint(path):
            name = tied.get(stored_name, stored_name)
            target = targets.get(name)
            if target is None:
                m = extra_layer.match(name)
                if any(p.match(name) for p in _IGNORED) or (m and int(m.group(1)) >= num_layers):
                    continue
                unexpected.append(stored_name)
                continue
            dest = target.view()
            shard = target.shard
            # Under tensor parallelism `dest` is this rank's slice: check the full shape.
            expected = tuple(dest.shape) if shard is None else shard.full_shape(tuple(dest.shape))
            shape = tuple(tensor.get_shape())
            if shape != expected:
                raise CheckpointError(
                    f"tensor {stored_name!r} has shape {shape} in the checkpoint, "
                    f"the model expects {expected}"
                )
            value = tensor[:] if shard is None else tensor[shard.index(len(shape))]
            if value.dtype in _FP8 and dest.dtype not in _FP8:
                raise CheckpointError(
                    f"tensor {stored_name!r} is stored in {value.dtype} (an FP8-quantized "
                    "checkpoint): only bf16/fp16/fp32 checkpoints are supported"
                )
            if name in seen:
                # NOTE: stored twice (an embedding tied to the LM head stored as both, or a
                # tensor in two shards): one copy serves only if they agree.
                if not torch.equal(dest, value.to(dest.dtype)):
                    why = " (config.json ties the embeddings)" if name in tied.values() else ""
                    raise CheckpointError(
                        f"checkpoint {str(path)!r} stores {name!r} twice with different values{why}"
                    )
                continue
            dest.copy_(value)
            seen.add(name)
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor(s) in checkpoint {str(path)!r}: {_names(unexpected)}"
        )
    missing = sorted(set(targets) - seen)
    if missing:
        raise CheckpointError(f"missing tensor(s) in checkpoint {str(path)!r}: {_names(missing)}")
    model.post_load()


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
