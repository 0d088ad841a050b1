"""An MLA-first LLM serving engine."""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, ModelConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

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
