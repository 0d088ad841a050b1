"""Decode steps replayed from captured CUDA graphs match the eager forward."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.executor.cuda_graph_runner import capture_sizes
from engine.executor.forward_batch import BatchEntry, ForwardMode, ScheduledBatch

PROMPTS = [[100 + 7 * i + j for j in range(3 + 9 * i)] for i in range(5)]


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


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
