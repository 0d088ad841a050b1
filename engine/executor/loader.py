"""Load an HF safetensors checkpoint (one file or sharded) into a model, checking every name."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.models.base import CausalLM

# Tensors that checkpoints carry but the engine does not use.
_IGNORED = (
    re.compile(r".*rotary_emb\.inv_freq$"),
    re.compile(r".*\.weight_scale_inv$"),  # NOTE: FP8-quantized checkpoints are not supported yet
)


class CheckpointError(ValueError):
    """The checkpoint does not match the model: missing, unexpected or misshapen tensors."""


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {str(path)!r}")
    return files


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = checkpoint_files(path)
    for file in tqdm(files, desc="loading weights", unit="file", disable=len(files) < 2):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_weights(model: CausalLM, path: str | Path, num_layers: int) -> None:
    """Copy every checkpoint tensor into its target, converting dtype on the way.

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
            if tuple(dest.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"tensor {stored_name!r} has shape {tuple(tensor.shape)} in the checkpoint, "
                    f"the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
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
