"""Rotary position embedding, with the scaled variants (YaRN, llama3, ...) of transformers.

Frequencies come from transformers' own RoPE initialisers (`ROPE_INIT_FUNCTIONS`), so every
scaling type it knows, YaRN as in DeepSeek-V2-Lite included, gives the same numbers as the
reference model. cos/sin are computed from the positions of each batch (cheap, and exact for any
position up to the model's limit).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2], attention_scaling) for this model."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, Hk, D] at the given positions [T].

    `interleaved`: rotate pairs (x0, x1), (x2, x3), ... (DeepSeek's layout) instead of the halves
    (x[:D/2], x[D/2:]) of Llama. The interleaved output is written de-interleaved (evens then
    odds); q and k get the same permutation, so their dot products are unchanged.
    """

    def __init__(self, hf_config: Any, head_dim: int, interleaved: bool = False) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_parameters(hf_config, head_dim)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
