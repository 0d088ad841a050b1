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

from engine.kernels.custom_ops import rotary_embedding


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


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, D/2] float32 (times the scaled variants' attention factor)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def apply_rope_native(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x [T, H, D] rotated by cos, sin [T, 1, D/2] (computed in x's dtype, as transformers does);
    interleaved pairs are written de-interleaved (evens then odds)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, Hk, D] at the given positions [T].

    `interleaved`: rotate pairs (x0, x1), (x2, x3), ... (DeepSeek's layout) instead of the halves
    (x[:D/2], x[D/2:]) of Llama. The interleaved output is written de-interleaved (evens then
    odds); q and k get the same permutation, so their dot products are unchanged.
    On CUDA one Triton kernel rotates q and k (`engine.kernels.rope`); MLA applies RoPE inside
    its own preamble kernel, reading `inv_freq` and `attention_scaling` from here.
    """

    def __init__(self, hf_config: Any, head_dim: int, interleaved: bool = False) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_parameters(hf_config, head_dim)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = interleaved
        # "auto": the Triton kernel on CUDA, the torch code elsewhere ("triton" / "native"
        # force one, for tests).
        self.kernel = "auto"

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.attention_scaling)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel == "triton" or (self.kernel == "auto" and q.is_cuda):
            return rotary_embedding(
                positions, q, k, self.inv_freq, self.attention_scaling, self.interleaved
            )
        cos, sin = self.cos_sin(positions)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return (
            apply_rope_native(q, cos, sin, self.interleaved),
            apply_rope_native(k, cos, sin, self.interleaved),
        )
