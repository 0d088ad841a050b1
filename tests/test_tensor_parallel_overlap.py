"""The single-GPU speed paths under tensor parallelism (issue 13 item 2), on CPU with gloo: the
overlap schedule over 2 ranks gives the serial schedule's outputs (greedy, seeded sampling, stop
strings and tokens found one step late, min_tokens, aborts in flight, chunked prefill, prefix
hits) and TP=1's greedy tokens; torch.compile over 2 ranks gives the eager tokens, with the
collectives traced into the graph as custom ops.

Only rank 0 samples: with overlap it resolves placeholder input ids and broadcasts the batch's
ids to the workers (ModelRunner `_resolve_placeholders`); a worker that embedded a placeholder
itself would index the vocabulary with a negative id, and its share of the output would differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_overlap import _assert_same, _check_idle, _prompts, _record_placeholders, _summary

from engine import LLM, SamplingParams
from engine.distributed import comm_ops
from engine.outputs import RequestOutput

GREEDY = dict(temperature=0.0)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _llm(model: str, tp_size: int, overlap: bool, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(
        dtype="float32",
        tp_size=tp_size,
        max_total_tokens=2048,
        max_running_requests=6,
        chunked_prefill_size=48,  # the 70-token stems take two chunks
        debug_checks=True,
        enable_overlap=overlap,
    )
    args.update(kw)
    llm = LLM(model, **args)
    assert llm.core.overlap is overlap
    return llm


def _mixed_params(prompts: list[list[int]], reference: list[list[int]]) -> list[SamplingParams]:
    """Greedy with logprobs, seeded top-k/top-p, a stop string, a stop token under min_tokens,
    and a stop token found in the middle of the reference output."""
    params = []
    for i, ref in enumerate(reference):
        mid = ref[2 + i % 5]
        kind = i % 5
        if kind == 0:
            p = SamplingParams(max_tokens=14, logprobs=True, ignore_eos=True, **GREEDY)
        elif kind == 1:
            p = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=40 + i)
        elif kind == 2:
            p = SamplingParams(max_tokens=14, stop=[" the", "."], **GREEDY)
        elif kind == 3:
            p = SamplingParams(max_tokens=14, stop_token_ids=[mid], min_tokens=2, **GREEDY)
        else:
            p = SamplingParams(max_tokens=14, stop_token_ids=[mid], ignore_eos=True, **GREEDY)
        params.append(p)
    return params


def _abort_in_flight(llm: LLM) -> dict[str, list[int]]:
    """Three requests; "b" is aborted after 5 tokens (with overlap, its next step is in flight)."""
    core = llm.core
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    finished: dict[str, str | None] = {}

    def cb(delta: RequestOutput) -> None:
        got[delta.request_id] += delta.token_ids
        if delta.finished:
            finished[delta.request_id] = delta.finish_reason

    params = SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    for i, rid in enumerate(got):
        core.add_request(rid, [500 + i * 50 + j for j in range(20)], params, cb)
    while len(got["b"]) < 5:
        core.step()
    core.abort("b")
    assert finished["b"] == "abort"
    core.scheduler.check_integrity()
    while core.has_work():
        core.step()
    assert finished == {"a": "length", "b": "abort", "c": "length"}
    assert len(got["b"]) == 5
    _check_idle(llm)
    return got


def test_tp2_overlap_equals_serial_and_tp1(tiny_mla) -> None:
    """DeepSeek-V2 with MoE over 2 ranks: overlap on == overlap off (the mixed batch twice, the
    second round hitting the prefix cache, and an abort while a step is in flight); greedy
    rows equal TP=1's."""
    model = tiny_mla("v2", moe=True, q_lora_rank=None)
    prompts = _prompts(10, seed=21)
    greedy = [SamplingParams(max_tokens=14, ignore_eos=True, **GREEDY) for _ in prompts]
    tp1 = _llm(model, 1, True)
    reference = [o.token_ids for o in tp1.generate(prompts, greedy)]
    params = _mixed_params(prompts, reference)
    results, aborts, trees = {}, {}, {}
    for overlap in (False, True):
        llm = _llm(model, 2, overlap)
        try:
            seen = _record_placeholders(llm)
            first = llm.generate(prompts, params)
            again = llm.generate([p + [7, 8] for p in prompts], params)
            results[overlap] = _summary(first) + _summary(again)
            assert bool(seen) is overlap
            _check_idle(llm)
            assert llm.core.scheduler.counters.cache_hit_tokens > 0
            trees[overlap] = llm.core.scheduler.tree.total_size()
            if overlap:  # the plain greedy batch: TP=2 with overlap gives TP=1's tokens
                assert [o.token_ids for o in llm.generate(prompts, greedy)] == reference
            aborts[overlap] = _abort_in_flight(llm)
        finally:
            llm.core.shutdown()
    _assert_same(results[False], results[True])
    assert aborts[False] == aborts[True]
    assert trees[False] == trees[True]
    # Every kind of request finished for its own reason at least once.
    reasons = {o[2] for o in results[True]}
    assert reasons == {"stop", "length"}


def test_tp2_overlap_default_model_uneven_split(default_model: str) -> None:
    """SmolLM2 (9 query heads: 6 + 3 over 2 ranks, the vocabulary split unevenly): greedy with
    overlap over 2 ranks equals TP=1, with retraction in a pool too small for everyone."""
    prompts = [p for p in _prompts(6, seed=23) if len(p) < 60]  # 105 prompt tokens
    params = SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY)
    expected = [o.token_ids for o in _llm(default_model, 1, False).generate(prompts, params)]
    llm = _llm(default_model, 2, True, max_total_tokens=128, max_running_requests=4)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.core.scheduler.counters.retractions > 0
        _check_idle(llm)
    finally:
        llm.core.shutdown()


# ---- torch.compile under TP ------------------------------------------------------------------
def test_comm_ops_single_rank_group() -> None:
    """The custom ops' schemas and fake implementations, over a gloo group of one rank."""
    store = torch.distributed.HashStore()
    group = torch.distributed.ProcessGroupGloo(store, 0, 1)
    name = comm_ops.register_group(group)
    try:
        x = torch.randn(3, 5)
        torch.library.opcheck(comm_ops.tp_all_reduce, (x.clone(), name))
        torch.library.opcheck(comm_ops.tp_all_gather, (x, name, 1))
        assert torch.equal(comm_ops.tp_all_gather(x, name, 1), x[None])
    finally:
        comm_ops.unregister_group(name)


@pytest.mark.parametrize("which,backend", [("mla", "torch_native"), ("llama", "triton")])
def test_tp2_compiled_decode_equals_eager(
    which: str, backend: str, request: pytest.FixtureRequest
) -> None:
    """torch.compile (aot_eager) over 2 ranks: the greedy tokens of eager TP=1, with overlap on.
    With the Triton backend (under the interpreter) the forward must be one graph (fullgraph):
    the all-reduces and the logits' all-gather trace as custom ops instead of breaking it (Llama
    there: on a CPU DeepSeek's experts run their torch loop, which breaks the graph; on CUDA
    they are the fused MoE's custom op)."""
    if which == "mla":
        model = request.getfixturevalue("tiny_mla")("v2", moe=True, q_lora_rank=None)
    else:
        model = request.getfixturevalue("tiny_llama")
    prompts = [[100 + 7 * i + j for j in range(3 + 5 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY)
    common: dict[str, Any] = dict(attention_backend=backend, max_total_tokens=256)
    if backend == "triton":
        common["max_context_len"] = 64
    eager = [o.token_ids for o in _llm(model, 1, False, **common).generate(prompts, params)]
    torch._dynamo.utils.counters.clear()
    llm = _llm(
        model,
        2,
        True,
        enable_torch_compile=True,
        torch_compile_backend="aot_eager",
        torch_compile_max_bs=4,
        **common,
    )
    try:
        compiled = llm.core.runner.compiled_decode
        assert compiled is not None and compiled.traceable is (backend == "triton")
        assert [o.token_ids for o in llm.generate(prompts, params)] == eager
        assert compiled.calls == params.max_tokens - 1 and compiled.compiled_sizes == {3}
        if backend == "triton":
            # fullgraph: a break would have raised; one graph per split-KV bucket (16, 32).
            assert not torch._dynamo.utils.counters["graph_break"]
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    finally:
        llm.core.shutdown()


# ---- on two GPUs (NCCL) ----------------------------------------------------------------------
def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def _strict_decode_launches(llm: LLM) -> list[bool]:
    """Launch every decode step under CUDA's sync debug mode "error" (any implicit host
    synchronization raises); records whether each read a placeholder."""
    launch = llm.core.runner.launch
    checked: list[bool] = []

    def strict(batch, sample_rows, requests):  # type: ignore[no-untyped-def]
        if batch.mode.value != "decode":
            return launch(batch, sample_rows, requests)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(batch, sample_rows, requests)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(any(t < 0 for e in batch.entries for t in e.input_ids))

    llm.core.runner.launch = strict  # type: ignore[method-assign]
    return checked


@pytest.mark.cuda
def test_tp2_cuda_overlap_equals_serial_without_host_sync(tiny_mla) -> None:
    """NCCL over 2 GPUs: overlap on == off == TP=1 (greedy and seeded, stops found late), and
    launching a decode step with placeholders waits for nothing on rank 0 (the broadcast of
    the resolved ids is ordered on the stream, not by the host)."""
    _two_gpus()
    model = tiny_mla("v2", moe=True, q_lora_rank=None)
    prompts = _prompts(8, seed=31)
    greedy = [SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY) for _ in prompts]
    common: dict[str, Any] = dict(attention_backend="triton", enable_cuda_graph=False)
    reference = [o.token_ids for o in _llm(model, 1, False, **common).generate(prompts, greedy)]
    params = _mixed_params(prompts, reference)
    results = {}
    for overlap in (False, True):
        llm = _llm(model, 2, overlap, **common)
        try:
            checked = _strict_decode_launches(llm)
            results[overlap] = _summary(llm.generate(prompts, params))
            assert any(checked) is overlap
            assert [o.token_ids for o in llm.generate(prompts, greedy)] == reference
            _check_idle(llm)
        finally:
            llm.core.shutdown()
    _assert_same(results[False], results[True])


@pytest.mark.cuda
def test_tp2_cuda_inductor_compile_equals_eager(tiny_mla) -> None:
    """Inductor over 2 GPUs (the fused MoE and the collectives as custom ops: one graph per
    size): the greedy tokens of eager TP=1."""
    _two_gpus()
    model = tiny_mla("v2", moe=True, q_lora_rank=None)
    prompts = _prompts(6, seed=33)
    params = SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)
    common: dict[str, Any] = dict(attention_backend="triton", enable_cuda_graph=False)
    eager = [o.token_ids for o in _llm(model, 1, False, **common).generate(prompts, params)]
    llm = _llm(model, 2, True, enable_torch_compile=True, torch_compile_max_bs=8, **common)
    try:
        compiled = llm.core.runner.compiled_decode
        assert compiled is not None and compiled.traceable
        assert [o.token_ids for o in llm.generate(prompts, params)] == eager
        assert compiled.calls > 0
    finally:
        llm.core.shutdown()


@pytest.mark.cuda
def test_tp2_cuda_graphs_equal_eager_tp1(tiny_mla) -> None:
    """CUDA graphs under TP (cuda_graph_with_tp): both ranks capture the same sizes and replay
    in step, the NCCL collectives inside the graphs; overlap on and off give the greedy tokens of
    eager TP=1, and rank 0 replays graphs."""
    _two_gpus()
    model = tiny_mla("v2", moe=True, q_lora_rank=None)
    prompts = _prompts(6, seed=35)
    params = SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)
    common: dict[str, Any] = dict(attention_backend="triton")
    tp1 = _llm(model, 1, False, enable_cuda_graph=False, **common)
    eager = [o.token_ids for o in tp1.generate(prompts, params)]
    for overlap in (False, True):
        llm = _llm(model, 2, overlap, cuda_graph_max_bs=8, cuda_graph_with_tp=True, **common)
        try:
            graphs = llm.core.runner.graph_runner
            assert graphs is not None
            assert [o.token_ids for o in llm.generate(prompts, params)] == eager
            assert graphs.replays > 0
            _check_idle(llm)
        finally:
            llm.core.shutdown()
