"""Model classes by the architecture name in config.json."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from engine.models.base import CausalLM

if TYPE_CHECKING:
    from engine.distributed.parallel_state import ParallelState


def model_class(architecture: str) -> type[CausalLM]:
    """The class for `architecture`; it is built as `cls(model_config, parallel_state)`."""
    from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
    from engine.models.llama import LlamaForCausalLM

    classes: dict[str, type[CausalLM]] = {
        "LlamaForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
        "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
    }
    if architecture not in classes:
        raise ConfigError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return classes[architecture]


def build_model(config: ModelConfig, parallel: ParallelState | None = None) -> CausalLM:
    """The model for this rank (`parallel`: its tensor-parallel group; None for one device)."""
    return model_class(config.architecture)(config, parallel)  # type: ignore[call-arg]
