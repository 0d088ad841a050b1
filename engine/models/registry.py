"""Model classes by the architecture name in config.json."""

from __future__ import annotations

from engine.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from engine.models.base import CausalLM


def model_class(architecture: str) -> type[CausalLM]:
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


def build_model(config: ModelConfig) -> CausalLM:
    return model_class(config.architecture)(config)
