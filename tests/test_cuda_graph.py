"""Decode steps replayed from captured CUDA graphs match the eager forward."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from engine import LLM, AsyncEngine, EngineConfig, RequestOutput, SamplingParams
from engine.executor.cuda_graph_runner import CudaGraphRunner, capture_sizes
from engine.scheduler.batch import BatchEntry, ForwardMode, ScheduledBatch

PROMPTS = [[100 + 7 * i + j for j in range(3 + 9 * i)] for i in range(5)]


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(256) == [1, 2, 4, *range(8, 65, 8), *range(80, 257, 16)]
    assert capture_sizes(70) == [1, 2, 4, *range(8, 65, 8), 70]


def test_no_graphs_on_cpu(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_total_tokens=128)
    assert llm.core.runner.graph_runner is None


def _decode_logits(llm: LLM, n: int):
    """Prefill the first n prompts at fixed slots, then decode one token for each."""
    runner = llm.core.runner
    slot0 = [1 + 50 * i for i in range(n)]
    prefill = [
        BatchEntry(i, p, 0, list(range(slot0[i], slot0[i] + len(p))))
        for i, p in enumerate(PROMPTS[:n])
    ]
    runner.forward(ScheduledBatch(ForwardMode.EXTEND, prefill))
    decode = [
        BatchEntry(i, [5 + i], len(p), [slot0[i] + len(p)]) for i, p in enumerate(PROMPTS[:n])
    ]
    return runner.forward(ScheduledBatch(ForwardMode.DECODE, decode)).float().cpu()


@pytest.mark.cuda
@pytest.mark.parametrize("which", ["mla", "llama"])
def test_graph_decode_matches_eager(which: str, request: pytest.FixtureRequest) -> None:
    if which == "mla":
        model = request.getfixturevalue("tiny_mla")("v2", moe=True, q_lora_rank=None)
    else:
        model = request.getfixturevalue("tiny_llama")
    common = dict(dtype="float32", max_total_tokens=512, attention_backend="triton")
    eager = LLM(model, enable_cuda_graph=False, **common)
    graph = LLM(model, enable_cuda_graph=True, cuda_graph_max_bs=4, **common)
    assert eager.core.runner.graph_runner is None
    graphs = graph.core.runner.graph_runner
    assert graphs is not None and graphs.capture_sizes == [1, 2, 4]

    # Whole generations, the batch shrinking from 5 (eager) through 4, 3 (padded), 2 and 1.
    params = [
        SamplingParams(max_tokens=3 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(5)
    ]
    expected = [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert [o.token_ids for o in graph.generate(PROMPTS, params)] == expected
    assert graphs.replays >= 10

    # Logits of decode batches of 1, 3 (padded to 4) and 5 (above the largest graph: eager).
    before = graphs.replays
    for n in (1, 3, 5):
        diff = (_decode_logits(eager, n) - _decode_logits(graph, n)).abs().max().item()
        assert diff < 1e-4, (n, diff)
    assert graphs.replays == before + 2


@pytest.mark.cuda
def test_capture_beside_a_running_async_engine(tiny_mla) -> None:
    """Issue 10: a graph capture while another engine's loop thread runs steps (the same process,
    after other engines ran) must neither fail nor poison the process's CUDA RNG."""
    model = tiny_mla("v2", moe=True, q_lora_rank=None)
    common = dict(model=model, dtype="float32", max_total_tokens=4096, attention_backend="triton")
    LLM(**common).generate([[7, 8, 9]], SamplingParams(max_tokens=4))  # an engine ran before
    engine = AsyncEngine(EngineConfig(enable_cuda_graph=True, cuda_graph_max_bs=8, **common))
    assert engine.core.runner.graph_runner is not None
    prompts = [[200 + 13 * i + j for j in range(5 + 3 * i)] for i in range(8)]
    greedy = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=120, temperature=0.8, ignore_eos=True)  # default RNG
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(8)}
    reasons: dict[str, str] = {}
    done = threading.Event()

    def on_delta(delta: RequestOutput) -> None:
        tokens[delta.request_id] += delta.token_ids
        if delta.finished:
            reasons[delta.request_id] = delta.finish_reason or ""
            if len(reasons) == len(tokens):
                done.set()

    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, sampled if i % 4 == 3 else greedy, on_delta)
        while min(len(t) for t in tokens.values()) < 2:
            time.sleep(0.01)
        for rid in ("r1", "r5"):
            engine.abort(rid)
        # Captured while the loop thread decodes (and samples with the default generator).
        other = LLM(enable_cuda_graph=True, cuda_graph_max_bs=8, **common)
        assert other.core.runner.graph_runner is not None
        assert done.wait(120), reasons
        assert reasons.pop("r1") == reasons.pop("r5") == "abort"
        assert set(reasons.values()) == {"length"}
        expected = other.generate([prompts[i] for i in (0, 2, 4, 6)], greedy)
        assert [tokens[f"r{i}"] for i in (0, 2, 4, 6)] == [o.token_ids for o in expected]
        assert engine.stats().num_running == 0
        torch.nn.init.normal_(torch.empty(16, device="cuda"))  # the default generator works
    finally:
        engine.shutdown()


@pytest.mark.cuda
def test_failed_capture_falls_back_to_eager(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A capture that fails leaves a usable process: eager decode, a warning, working RNG."""
    common = dict(dtype="float32", max_total_tokens=512, attention_backend="triton")
    real_run = CudaGraphRunner._run_model

    def sync_while_capturing(self: CudaGraphRunner, fb: object) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not permitted during capture: invalidates it
        return real_run(self, fb)  # type: ignore[arg-type]

    monkeypatch.setattr(CudaGraphRunner, "_run_model", sync_while_capturing)
    with caplog.at_level(logging.WARNING):
        broken = LLM(tiny_llama, enable_cuda_graph=True, cuda_graph_max_bs=4, **common)
    assert broken.core.runner.graph_runner is None
    assert "capture failed" in caplog.text and "batch size 4" in caplog.text
    torch.nn.init.normal_(torch.empty(16, device="cuda"))  # the default generator works
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = LLM(tiny_llama, enable_cuda_graph=False, **common).generate(PROMPTS, params)
    assert [o.token_ids for o in broken.generate(PROMPTS, params)] == [o.token_ids for o in eager]
    monkeypatch.undo()
    again = LLM(tiny_llama, enable_cuda_graph=True, cuda_graph_max_bs=4, **common)
    assert again.core.runner.graph_runner is not None
    sampled = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    assert all(len(o.token_ids) == 8 for o in again.generate(PROMPTS, sampled))


@pytest.fixture(scope="module")
def v2lite_two_layers(tiny_mla) -> str:
    """DeepSeek-V2-Lite's shape (hidden 2048, 16 heads, kv_lora_rank 512, 64 experts top-6 + 2
    shared), 2 of its 27 layers (one dense, one MoE), random bf16 weights."""
    from engine.tools.make_random_checkpoint import PRESETS

    shape = dict(PRESETS["v2-lite"], layers=2)
    return str(tiny_mla("v2", weight_scale=0.02, save_dtype=torch.bfloat16, **shape))


def _teacher_forced_logits(llm: LLM, prompts: list[list[int]], forced: list[list[int]]):
    """Prefill every prompt, then decode the forced tokens step by step (all requests in one
    batch); the logits of every decode step, [steps, B, V] float32 on the CPU."""
    runner = llm.core.runner
    starts = [1 + 1024 * i for i in range(len(prompts))]
    prefill = [
        BatchEntry(i, p, 0, list(range(starts[i], starts[i] + len(p))))
        for i, p in enumerate(prompts)
    ]
    runner.forward(ScheduledBatch(ForwardMode.EXTEND, prefill))
    out = []
    for step in range(len(forced[0])):
        decode = [
            BatchEntry(i, [forced[i][step]], len(p) + step, [starts[i] + len(p) + step])
            for i, p in enumerate(prompts)
        ]
        out.append(runner.forward(ScheduledBatch(ForwardMode.DECODE, decode)).float().cpu())
    return torch.stack(out)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_v2lite_graph_decode_matches_eager(v2lite_two_layers: str, kv_cache_dtype: str) -> None:
    """Issue 12: on the real model shape, in bf16, decode replayed from CUDA graphs (with the
    fused kernels) gives the eager path's logits within bf16 tolerance, teacher-forced."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (7, 40, 130, 300, 515)]
    forced = [[rng.randrange(100, 40000) for _ in range(12)] for _ in prompts]
    common = dict(
        dtype="bfloat16",
        max_total_tokens=8192,
        kv_cache_dtype=kv_cache_dtype,
        max_running_requests=8,
    )
    eager = LLM(v2lite_two_layers, enable_cuda_graph=False, **common)
    ref = _teacher_forced_logits(eager, prompts, forced)
    del eager
    graph = LLM(v2lite_two_layers, enable_cuda_graph=True, cuda_graph_max_bs=8, **common)
    graphs = graph.core.runner.graph_runner
    assert graphs is not None
    got = _teacher_forced_logits(graph, prompts, forced)
    assert graphs.replays == 12  # every decode step (5 requests, padded to 8) ran from a graph
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 0.03 * scale
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


@pytest.mark.cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_v2lite_batch1_kernels_match_torch_path(
    v2lite_two_layers: str, kv_cache_dtype: str
) -> None:
    """Issue 12: batch-1 decode from CUDA graphs with the batch-1 kernels (the one-row GEMV
    projections, the small-M W_UK / W_UV GEMMs, the preamble's own pool store, the MoE GEMMs
    aligning in-program) gives the torch path's logits (every module's `kernel` "native",
    eager) within bf16 tolerance, teacher-forced on the real shape."""
    import random

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(300)]]
    forced = [[rng.randrange(100, 40000) for _ in range(16)]]
    common = dict(dtype="bfloat16", max_total_tokens=4096, kv_cache_dtype=kv_cache_dtype)
    native = LLM(v2lite_two_layers, enable_cuda_graph=False, **common)
    modules = [
        m for m in native.core.runner.model.modules() if isinstance(getattr(m, "kernel", None), str)
    ]
    assert modules
    for m in modules:
        m.kernel = "native"  # type: ignore[assignment]
    ref = _teacher_forced_logits(native, prompts, forced)
    del native, modules
    fused = LLM(v2lite_two_layers, enable_cuda_graph=True, cuda_graph_max_bs=8, **common)
    graphs = fused.core.runner.graph_runner
    assert graphs is not None
    got = _teacher_forced_logits(fused, prompts, forced)
    assert graphs.replays == len(forced[0])  # every batch-1 step from a graph
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 0.03 * scale
    cos = torch.nn.functional.cosine_similarity(got.flatten(1), ref.flatten(1), dim=-1)
    assert cos.min().item() >= 0.999, cos


@pytest.mark.cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_v2lite_pdl_launches_match_plain_launches(
    v2lite_two_layers: str, kv_cache_dtype: str
) -> None:
    """Programmatic dependent launch only lets a kernel start early; a kernel that read or
    wrote too soon would show as logits that differ from plain launches (bitwise: the same
    kernels run). Batch 1 and 5, from CUDA graphs, teacher-forced on the real shape."""
    import random

    from engine.kernels import launch as launch_mod

    if not launch_mod.pdl_active(0):
        pytest.skip("no PDL on this GPU or Triton")
    rng = random.Random(2)
    wanted = launch_mod._PDL_WANTED
    common = dict(
        dtype="bfloat16", max_total_tokens=8192, kv_cache_dtype=kv_cache_dtype,
        enable_cuda_graph=True, cuda_graph_max_bs=8,
    )  # fmt: skip
    for n in (1, 5):
        prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 400))]]
        prompts += [[rng.randrange(100, 40000) for _ in range(50 * i + 3)] for i in range(n - 1)]
        forced = [[rng.randrange(100, 40000) for _ in range(10)] for _ in prompts]
        got = {}
        for pdl in (False, True):
            launch_mod.set_pdl(pdl)
            try:
                llm = LLM(v2lite_two_layers, **common)
                got[pdl] = _teacher_forced_logits(llm, prompts, forced)
                assert llm.core.runner.graph_runner.replays == len(forced[0])
                del llm
            finally:
                launch_mod.set_pdl(wanted)
        assert torch.equal(got[True], got[False]), (got[True] - got[False]).abs().max()
