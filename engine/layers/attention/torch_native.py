"""The reference attention backend: plain PyTorch (SDPA), runs on CPU and GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.executor.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionBackend, AttentionLayer


class TorchNativeBackend(AttentionBackend):
    """Extend attends request by request; decode pads the batch to its longest context."""

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        rows = fb.req_to_token[fb.req_pool_indices]  # [B, max_context_len]
        if fb.is_decode:
            max_len = max(fb.seq_lens_cpu)
            slots = rows[:, :max_len].long()  # [B, L]
            arange = torch.arange(max_len, device=slots.device)
            valid = arange[None, :] < fb.seq_lens[:, None]  # [B, L]
            fb.attn_metadata["decode_slots"] = slots.masked_fill(~valid, 0)
            fb.attn_metadata["decode_mask"] = valid
        else:
            context = [rows[i, :n].long() for i, n in enumerate(fb.seq_lens_cpu)]
            fb.attn_metadata["context_slots"] = context
            fb.attn_metadata["all_context_slots"] = torch.cat(context)

    def forward_extend(self, q, k, v, layer, fb, save_kv=True):
        if save_kv and k is not None:
            fb.kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        start = 0
        context: list[torch.Tensor] = fb.attn_metadata["context_slots"]  # type: ignore[assignment]
        for i, slots in enumerate(context):
            n = fb.extend_lens_cpu[i]
            ck, cv = fb.kv_pool.get_kv(layer.layer_id, slots)
            out[start : start + n] = _causal_attention(
                q[start : start + n], ck, cv, fb.prefix_lens_cpu[i], layer
            )
            start += n
        return out

    def forward_extend_ragged(self, q, k, v, layer, fb):
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        q_start = kv_start = 0
        for i, seq_len in enumerate(fb.seq_lens_cpu):
            n = fb.extend_lens_cpu[i]
            out[q_start : q_start + n] = _causal_attention(
                q[q_start : q_start + n],
                k[kv_start : kv_start + seq_len],
                v[kv_start : kv_start + seq_len],
                fb.prefix_lens_cpu[i],
                layer,
            )
            q_start += n
            kv_start += seq_len
        return out

    def forward_decode(self, q, k, v, layer, fb, save_kv=True):
        if save_kv and k is not None:
            fb.kv_pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        slots: torch.Tensor = fb.attn_metadata["decode_slots"]  # type: ignore[assignment]
        mask: torch.Tensor = fb.attn_metadata["decode_mask"]  # type: ignore[assignment]
        ck, cv = fb.kv_pool.get_kv(layer.layer_id, slots)  # [B, L, kv_heads, dim]
        # SDPA layout: [B, heads, q_len, dim]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            ck.transpose(1, 2),
            cv.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=layer.scaling,
            enable_gqa=layer.num_kv_heads != layer.num_heads,
        )
        return out.squeeze(2)

    def gather_context(self, layer_id: int, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        slots: torch.Tensor = fb.attn_metadata["all_context_slots"]  # type: ignore[assignment]
        return fb.kv_pool.get_kv(layer_id, slots)


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, layer: AttentionLayer
) -> torch.Tensor:
    """q [n, H, D] are the positions prefix_len.. of a sequence whose keys are k [L, Hkv, D]."""
    n, total = q.shape[0], k.shape[0]
    # Query i sits at absolute position prefix_len + i and sees keys 0..prefix_len + i.
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=prefix_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=layer.scaling,
        enable_gqa=layer.num_kv_heads != layer.num_heads,
    )
    return out.transpose(0, 1)
