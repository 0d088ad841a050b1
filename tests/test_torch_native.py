"""The torch-native backend's decode over requests of very different context lengths."""

from __future__ import annotations

import random

import torch

from engine.forward_batch import ForwardBatch, ForwardContext
from engine.layers.attention.base import AttentionLayer
from engine.layers.attention.torch_native import (
    TorchNativeBackend,
    bucket_by_length,
    causal_attention,
)
from engine.mem_cache.kv_pool import MHATokenToKVPool
from engine.scheduler.batch import ForwardMode


def test_buckets_bound_padding_and_cover_every_row() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lens = [
            rng.choice([1, 3, 17, 600, 6000]) + rng.randrange(5)
            for _ in range(rng.randrange(1, 40))
        ]
        groups = bucket_by_length(lens)
        assert sorted(i for g in groups for i in g) == list(range(len(lens)))
        padded = sum(len(g) * max(lens[i] for i in g) for g in groups)
        assert padded <= 2.0 * sum(lens)
    assert bucket_by_length([5, 6, 7]) == [[2, 1, 0]]  # similar lengths: one call
    assert len(bucket_by_length([6000] + [10] * 100)) == 2  # the long one alone


def test_decode_over_mixed_lengths_matches_per_request_attention() -> None:
    torch.manual_seed(0)
    lens = [600, 3, 5, 40, 1, 41]
    heads, kv_heads, dim = 4, 2, 8
    pool = MHATokenToKVPool(1024, 1, kv_heads, dim, dim, torch.float32, torch.device("cpu"))
    req_to_token = torch.zeros(len(lens), 700, dtype=torch.int32)
    start = 1
    for r, n in enumerate(lens):
        req_to_token[r, :n] = torch.arange(start, start + n)
        start += n
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    backend = TorchNativeBackend(pool)
    ctx = ForwardContext(req_to_token, pool, backend)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    fb = ForwardBatch.build(
        ForwardMode.DECODE,
        ctx,
        input_ids=ints([0] * len(lens)),
        positions=ints([n - 1 for n in lens]),
        out_cache_loc=ints([0] * len(lens)),
        req_pool_indices=ints(list(range(len(lens)))),
        seq_lens=ints(lens),
        extend_lens=ints([1] * len(lens)),
        seq_lens_cpu=lens,
        prefix_lens_cpu=[n - 1 for n in lens],
        extend_lens_cpu=[1] * len(lens),
    )
    backend.init_forward_metadata(fb)
    assert len(fb.attn_metadata.decode_buckets) > 1
    layer = AttentionLayer(0, heads, kv_heads, dim, dim, 0.3)
    q = torch.randn(len(lens), heads, dim)
    out = backend.forward_decode(q, layer, fb)
    for r, n in enumerate(lens):
        slots = req_to_token[r, :n].long()
        k, v = pool.get_kv(0, slots)
        ref = causal_attention(q[r : r + 1], k, v, n - 1, 0.3)[0]
        torch.testing.assert_close(out[r], ref, atol=1e-5, rtol=1e-5)
