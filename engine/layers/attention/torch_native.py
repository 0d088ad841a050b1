"""The reference attention backend: plain PyTorch (SDPA), runs on CPU and GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionBackend, AttentionLayer


@dataclass
class DecodeBucket:
    """Decode requests of similar context length, attended in one padded SDPA call."""

    rows: torch.Tensor | None  # [b] their rows in the batch; None: the whole batch, in order
    slots: torch.Tensor  # [b, L] int64 context slots, padding slot 0
    mask: torch.Tensor  # [b, L] bool


@dataclass
class TorchNativeMetadata:
    """Decode: the requests in buckets of similar context length, each padded to its longest.
    Extend: each request's context slots, and all of them concatenated in batch order."""

    decode_buckets: list[DecodeBucket] | None = None
    context_slots: list[torch.Tensor] | None = None  # [seq_len_i] int64 each
    all_context_slots: torch.Tensor | None = None  # [sum(seq_lens)] int64


def bucket_by_length(seq_lens: list[int], max_waste: float = 2.0) -> list[list[int]]:
    """Group batch rows so that padding each group to its longest context costs at most
    `max_waste` times the group's real context: decode work stays near-linear in the total
    context, however mixed the lengths (one 6,000-token request does not make 100 short ones
    read 6,000 rows each). Rows longest first; few groups for similar lengths."""
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        n = seq_lens[i]
        if groups and (len(groups[-1]) + 1) * seq_lens[groups[-1][0]] <= max_waste * (total + n):
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


class TorchNativeBackend(AttentionBackend):
    """Extend attends request by request; decode pads the batch to its longest context. Its
    index tensors need the host's sequence lengths, so it captures no CUDA graphs."""

    @staticmethod
    def build_metadata(fb: ForwardBatch) -> TorchNativeMetadata:
        rows = fb.req_to_token[fb.req_pool_indices]  # [B, max_context_len]
        if fb.is_decode:
            groups = bucket_by_length(fb.seq_lens_cpu)
            buckets = []
            for group in groups:
                max_len = fb.seq_lens_cpu[group[0]]
                whole = len(groups) == 1
                idx = None if whole else torch.tensor(group, device=rows.device)
                slots = (rows if idx is None else rows[idx])[:, :max_len].long()  # [b, L]
                lens = fb.seq_lens if idx is None else fb.seq_lens[idx]
                valid = torch.arange(max_len, device=rows.device)[None, :] < lens[:, None]
                buckets.append(DecodeBucket(idx, slots.masked_fill(~valid, 0), valid))
            return TorchNativeMetadata(decode_buckets=buckets)
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

    def forward_extend_ragged(self, q, k, v, layer, fb, rope=None):
        if rope is not None:  # the whole heads: [q | q_pe], [k | k_pe for every head]
            q_pe, k_pe = rope
            q = torch.cat([q, q_pe], dim=-1)
            k = torch.cat([k, k_pe.expand(-1, k.shape[1], -1)], dim=-1)
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

    def forward_decode(self, q, layer, fb, value_proj=None):
        out = self._decode(q, layer, fb)
        return out if value_proj is None else torch.einsum("thc,hcv->thv", out, value_proj)

    def _decode(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch) -> torch.Tensor:
        meta: TorchNativeMetadata = fb.attn_metadata
        assert meta.decode_buckets is not None
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        for b in meta.decode_buckets:
            ck, cv = self.kv_pool.get_kv(layer.layer_id, b.slots)  # [b, L, kv_heads, dim]
            # SDPA layout: [b, heads, q_len, dim]
            o = F.scaled_dot_product_attention(
                (q if b.rows is None else q[b.rows]).unsqueeze(2),
                ck.transpose(1, 2),
                cv.transpose(1, 2),
                attn_mask=b.mask[:, None, None, :],
                scale=layer.scaling,
                enable_gqa=layer.num_kv_heads != layer.num_heads,
            ).squeeze(2)
            if b.rows is None:
                return o
            out[b.rows] = o
        return out

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
