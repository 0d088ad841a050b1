"""An MLA-first LLM serving engine.

The public names are imported on first use, so `import engine.scheduler` (or the launcher,
`engine.serve`) does not pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig, ModelConfig
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, EngineStats, RequestOutput
    from engine.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncEngine": "engine.async_engine",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "EngineStats": "engine.outputs",
    "ModelConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
