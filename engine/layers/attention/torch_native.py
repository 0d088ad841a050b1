"""The reference attention backend: plain PyTorch (SDPA), runs on CPU and GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionBackend, AttentionLayer


@dataclass
class TorchNativeMetadata:
    """Decode: every request's context slots, padded to the longest ([B, L], with a mask).
    Extend: each request's context slots, and all of them concatenated in batch order."""

    decode_slots: torch.Tensor | None = None  # [B, L] int64, padding slot 0
    decode_mask: torch.Tensor | None = None  # [B, L] bool
    context_slots: list[torch.Tensor] | None = None  # [seq_len_i] int64 each
    all_context_slots: torch.Tensor | None = None  # [sum(seq_lens)] int64


class TorchNativeBackend(AttentionBackend):
    """Extend attends request by request; decode pads the batch to its longest context. Its
    index tensors need the host's sequence lengths, so it captures no CUDA graphs."""

    @staticmethod
    def build_metadata(fb: ForwardBatch) -> TorchNativeMetadata:
        rows = fb.req_to_token[fb.req_pool_indices]  # [B, max_context_len]
        if fb.is_decode:
            max_len = max(fb.seq_lens_cpu)
            slots = rows[:, :max_len].long()  # [B, L]
            arange = torch.arange(max_len, device=slots.device)
            valid = arange[None, :] < fb.seq_lens[:, None]  # [B, L]
            return TorchNativeMetadata(decode_slots=slots.masked_fill(~valid, 0), decode_mask=valid)
        context = [rows[i, :n].long() for i, n in enumerate(fb.seq_lens_cpu)]
        return TorchNativeMetadata(context_slots=context, all_context_slots=torch.cat(context))

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        fb.attn_metadata = self.build_metadata(fb)

    def forward_extend(self, q, k, v, layer, fb):
        return self.extend_from_pool(q, layer, fb, fb.attn_metadata)

    def extend_from_pool(
        self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch, meta: TorchNativeMetadata
    ) -> torch.Tensor:
        """Extend attention over the contexts read back from the pool (after store_kv)."""
        assert meta.context_slots is not None
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        start = 0
        for i, slots in enumerate(meta.context_slots):
            n = fb.extend_lens_cpu[i]
            ck, cv = self.kv_pool.get_kv(layer.layer_id, slots)
            out[start : start + n] = causal_attention(
                q[start : start + n], ck, cv, fb.prefix_lens_cpu[i], layer.scaling
            )
            start += n
        return out

    def forward_extend_ragged(self, q, k, v, layer, fb):
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        q_start = kv_start = 0
        for i, seq_len in enumerate(fb.seq_lens_cpu):
            n = fb.extend_lens_cpu[i]
            out[q_start : q_start + n] = causal_attention(
                q[q_start : q_start + n],
                k[kv_start : kv_start + seq_len],
                v[kv_start : kv_start + seq_len],
                fb.prefix_lens_cpu[i],
                layer.scaling,
            )
            q_start += n
            kv_start += seq_len
        return out

    def forward_decode(self, q, layer, fb):
        meta: TorchNativeMetadata = fb.attn_metadata
        assert meta.decode_slots is not None and meta.decode_mask is not None
        ck, cv = self.kv_pool.get_kv(layer.layer_id, meta.decode_slots)  # [B, L, kv_heads, dim]
        # SDPA layout: [B, heads, q_len, dim]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            ck.transpose(1, 2),
            cv.transpose(1, 2),
            attn_mask=meta.decode_mask[:, None, None, :],
            scale=layer.scaling,
            enable_gqa=layer.num_kv_heads != layer.num_heads,
        )
        return out.squeeze(2)

    def gather_context(self, layer_id, fb):
        return self.gather_from(layer_id, fb.attn_metadata)

    def gather_from(
        self, layer_id: int, meta: TorchNativeMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert meta.all_context_slots is not None
        return self.kv_pool.get_kv(layer_id, meta.all_context_slots)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """q [n, H, D] are the positions prefix_len.. of a sequence whose keys are k [L, Hkv, D] and
    values v [L, Hkv, Dv] (Hkv divides H) -> [n, H, Dv]."""
    n, total = q.shape[0], k.shape[0]
    # Query i sits at absolute position prefix_len + i and sees keys 0..prefix_len + i.
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=prefix_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.transpose(0, 1)
