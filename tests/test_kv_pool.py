"""KV pools: layouts, FP8 storage, and an engine run on an FP8 cache."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.mem_cache.kv_pool import FP8_DTYPE, MHATokenToKVPool, MLATokenToKVPool
from engine.scheduler.batch import BatchEntry, ForwardMode, ScheduledBatch

CPU = torch.device("cpu")


def test_mla_pool_row_is_latent_plus_rope_and_value_is_a_view() -> None:
    pool = MLATokenToKVPool(
        16, 2, kv_lora_rank=8, qk_rope_head_dim=4, dtype=torch.float32, device=CPU
    )
    rows = torch.randn(3, 1, 12)
    pool.set_kv(1, torch.tensor([5, 6, 7]), rows, None)
    k, v = pool.get_kv(1, torch.tensor([5, 6, 7]))
    assert k.equal(rows) and v.equal(rows[..., :8])
    assert pool.kv_buffer[1].shape == (17, 1, 12)  # slot 0 is the padding sink
    assert pool.kv_buffer[0].abs().sum() == 0  # other layers untouched


def test_fp8_pools_store_e4m3_and_round_trip_within_its_precision() -> None:
    torch.manual_seed(0)
    mla = MLATokenToKVPool(8, 1, 8, 4, torch.float32, CPU, kv_cache_dtype="fp8_e4m3")
    mha = MHATokenToKVPool(8, 1, 2, 4, 4, torch.float32, CPU, kv_cache_dtype="fp8_e4m3")
    assert mla.kv_buffer[0].dtype == FP8_DTYPE and mha.k_buffer[0].dtype == FP8_DTYPE
    x = torch.randn(4, 1, 12) * 3
    loc = torch.tensor([1, 2, 3, 4])
    mla.set_kv(0, loc, x, None)
    back = mla.get_kv(0, loc)[0]
    assert back.dtype == torch.float32
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for normal values.
    assert ((back - x).abs() <= x.abs() / 16 + 2**-9).all()
    k, v = torch.randn(4, 2, 4), torch.randn(4, 2, 4)
    mha.set_kv(0, loc, k, v)
    k2, v2 = mha.get_kv(0, loc)
    assert ((k2 - k).abs() <= k.abs() / 16 + 2**-9).all()
    assert ((v2 - v).abs() <= v.abs() / 16 + 2**-9).all()
    assert (
        mla.bytes_per_token() * 4
        == MLATokenToKVPool(8, 1, 8, 4, torch.float32, CPU).bytes_per_token()
    )


def test_engine_on_fp8_cache_follows_the_full_precision_run(default_model: str) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(200, 260))
    exact = LLM(default_model, dtype="float32", max_total_tokens=512).generate([prompt], params)
    fp8 = LLM(
        default_model,
        dtype="float32",
        max_total_tokens=512,
        kv_cache_dtype="fp8_e4m3",
        debug_checks=True,
    )
    assert fp8.core.runner.kv_pool.store_dtype == FP8_DTYPE
    assert fp8.generate([prompt], params)[0].token_ids == exact[0].token_ids


def test_mla_decode_on_fp8_latents_stays_close(tiny_mla) -> None:
    """Random weights leave small logit gaps, so greedy paths may part after a few tokens; the
    logits of a decode step over an FP8 latent cache must stay close to the exact ones."""
    model = tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True)
    prompt = list(range(200, 260))
    logits = []
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        llm = LLM(model, dtype="float32", max_total_tokens=512, kv_cache_dtype=kv_cache_dtype)
        runner = llm.core.runner
        slots = list(range(1, len(prompt) + 2))
        runner.forward(ScheduledBatch(ForwardMode.EXTEND, [BatchEntry(0, prompt, 0, slots[:-1])]))
        step = BatchEntry(0, [7], len(prompt), slots[-1:])
        logits.append(runner.forward(ScheduledBatch(ForwardMode.DECODE, [step]))[0].cpu())
    exact, fp8 = logits
    cosine = torch.nn.functional.cosine_similarity(exact, fp8, dim=0).item()
    assert cosine > 0.995
    assert (exact - fp8).abs().max().item() < 0.1 * exact.abs().max().item()
