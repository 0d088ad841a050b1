"""Token-to-KV pools: what a KV slot holds, per layer. The runner owns these tensors.

Two layouts share one slot space (the radix cache and scheduler deal in slot ids only):
- `MHATokenToKVPool`: K [slots, kv_heads, head_dim] and V [slots, kv_heads, v_head_dim] per layer.
- `MLATokenToKVPool`: one row [slots, 1, kv_lora_rank + qk_rope_head_dim] per layer: the compressed
  latent followed by the shared RoPE key. V is a view of the first kv_lora_rank columns.
With kv_cache_dtype "fp8_e4m3" the rows are stored as float8_e4m3fn and multiplied by a per-layer
scale on read (the scale is 1.0 unless calibrated, as in SGLang and vLLM without calibration). The
scales live here only, as [1] fp32 device tensors: the torch path and the kernels read the same
ones.

NOTE: slot 0 is a padding sink: padded batch entries write there and nothing reads it as context.
"""

from __future__ import annotations

import torch

from engine.kernels.fp8 import FP8_DTYPE, quantize_fp8
from engine.kernels.kv_store import gather_dequant


class KVPool:
    """Common interface of the pools.

    `set_kv` writes the new tokens' entries at `loc`; `get_kv` reads the given slots back in the
    compute dtype (dequantized), as [n, kv_heads, dim] key and value tensors.
    """

    size: int  # usable slots, not counting the reserved page 0 (slot 0 with page size 1)
    page_size: int
    dtype: torch.dtype  # compute dtype
    store_dtype: torch.dtype
    num_layers: int
    k_scale: list[torch.Tensor]  # per layer, [1] fp32; FP8 value = stored * scale
    v_scale: list[torch.Tensor]  # MLA: the same tensors as k_scale (V is part of the row)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None):
        raise NotImplementedError

    def get_kv(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def bytes_per_token(self) -> int:
        raise NotImplementedError

    @property
    def is_fp8(self) -> bool:
        return self.store_dtype == FP8_DTYPE

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.store_dtype != FP8_DTYPE:
            return x.to(self.store_dtype)
        return quantize_fp8(x, scale)

    def _gather(
        self, buffer: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        """buffer[slots] in the compute dtype (an FP8 pool's rows times its scale)."""
        if self.store_dtype != FP8_DTYPE:
            return buffer[slots]
        return gather_dequant(buffer, slots, scale, self.dtype)


def _store_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    return FP8_DTYPE if kv_cache_dtype == "fp8_e4m3" else dtype


def _unit_scales(num_layers: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.ones(1, dtype=torch.float32, device=device) for _ in range(num_layers)]


class MHATokenToKVPool(KVPool):
    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        page_size: int = 1,
    ) -> None:
        self.size, self.num_layers, self.dtype = size, num_layers, dtype
        self.page_size = page_size
        self.store_dtype = _store_dtype(dtype, kv_cache_dtype)
        shape = (size + page_size, num_kv_heads)
        self.k_buffer = [
            torch.zeros(*shape, head_dim, dtype=self.store_dtype, device=device)
            for _ in range(num_layers)
        ]
        self.v_buffer = [
            torch.zeros(*shape, v_head_dim, dtype=self.store_dtype, device=device)
            for _ in range(num_layers)
        ]
        self.k_scale = _unit_scales(num_layers, device)
        self.v_scale = _unit_scales(num_layers, device)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None):
        assert v is not None
        self.k_buffer[layer_id][loc] = self._quantize(k, self.k_scale[layer_id])
        self.v_buffer[layer_id][loc] = self._quantize(v, self.v_scale[layer_id])

    def get_kv(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._gather(self.k_buffer[layer_id], slots, self.k_scale[layer_id])
        v = self._gather(self.v_buffer[layer_id], slots, self.v_scale[layer_id])
        return k, v

    def bytes_per_token(self) -> int:
        per_layer = self.k_buffer[0][0].numel() + self.v_buffer[0][0].numel()
        return per_layer * self.num_layers * self.k_buffer[0].element_size()


class MLATokenToKVPool(KVPool):
    def __init__(
        self,
        size: int,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        page_size: int = 1,
    ) -> None:
        self.size, self.num_layers, self.dtype = size, num_layers, dtype
        self.page_size = page_size
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.store_dtype = _store_dtype(dtype, kv_cache_dtype)
        dim = kv_lora_rank + qk_rope_head_dim
        self.kv_buffer = [
            torch.zeros(size + page_size, 1, dim, dtype=self.store_dtype, device=device)
            for _ in range(num_layers)
        ]
        self.k_scale = _unit_scales(num_layers, device)
        self.v_scale = self.k_scale

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None):
        """k: [n, 1, kv_lora_rank + rope] latent rows; v is unused (it is part of k)."""
        self.kv_buffer[layer_id][loc] = self._quantize(k, self.k_scale[layer_id])

    def get_kv(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._gather(self.kv_buffer[layer_id], slots, self.k_scale[layer_id])
        return k, k[..., : self.kv_lora_rank]

    def bytes_per_token(self) -> int:
        return self.kv_buffer[0][0].numel() * self.num_layers * self.kv_buffer[0].element_size()
