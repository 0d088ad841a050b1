"""The overlap schedule (`enable_overlap`) gives the same outputs as the serial one.

On a CPU the model runs synchronously, so nothing is hidden, but the code path is the one a GPU
takes: step n+1 is scheduled and launched before step n's tokens are processed, its decode
inputs are placeholders read from step n's sampled ids, and requests that step n finishes have
a wasted row in step n+1 whose token and KV slot are dropped.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import CompletionOutput, RequestOutput

GREEDY = dict(temperature=0.0)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with shared prefixes of several lengths (prefix-cache hits) and long ones
    (chunked prefill)."""
    rng = random.Random(seed)
    stems = [[rng.randrange(100, 20000) for _ in range(k)] for k in (6, 40, 70)]
    out = []
    for i in range(n):
        stem = stems[i % len(stems)] if i % 4 else []
        out.append(stem + [rng.randrange(100, 20000) for _ in range(rng.randrange(1, 30))])
    return out


def _llm(model: str, overlap: bool, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(
        dtype="float32",
        max_total_tokens=2048,
        max_running_requests=6,  # fewer than the requests: some wait, join between steps
        chunked_prefill_size=48,
        debug_checks=True,
        enable_overlap=overlap,
    )
    args.update(kw)
    llm = LLM(model, **args)
    assert llm.core.overlap is overlap
    return llm


def _record_placeholders(llm: LLM) -> list[int]:
    """Count the launched batches that read a token still on the device (wraps the runner)."""
    seen: list[int] = []
    launch = llm.core.runner.launch

    def wrapped(batch, sample_rows, requests):  # type: ignore[no-untyped-def]
        if any(t < 0 for e in batch.entries for t in e.input_ids):
            seen.append(1)
        return launch(batch, sample_rows, requests)

    llm.core.runner.launch = wrapped  # type: ignore[method-assign]
    return seen


def _summary(outs: list[CompletionOutput]) -> list[tuple[Any, ...]]:
    return [
        (
            o.token_ids, o.text, o.finish_reason, o.logprobs, o.cumulative_logprob,
            o.logprob_ranks, o.top_logprobs,
        )
        for o in outs
    ]  # fmt: skip


def _assert_same(serial: list[tuple[Any, ...]], overlap: list[tuple[Any, ...]]) -> None:
    """Tokens, text and finish reasons exactly; logprobs to float32 rounding.

    With overlap a finished request frees its row one step later, so a waiting request may be
    admitted a step later: it may share a batch with other requests, or find a prefix in the
    cache that another request has just computed, and its logits differ in the last bits (as
    they do between batch compositions without overlap). `cached_tokens` may differ for the
    same reason."""
    assert [o[:3] for o in serial] == [o[:3] for o in overlap]
    for a, b in zip(serial, overlap, strict=True):
        assert (a[3] is None) == (b[3] is None)
        if a[3] is not None:
            assert b[3] == pytest.approx(a[3], abs=1e-4)
        assert b[4] == pytest.approx(a[4], abs=1e-3)


def _check_idle(llm: LLM) -> None:
    sched = llm.core.scheduler
    sched.check_integrity()
    assert sched.in_use_slots() == 0
    assert not llm.core.states and not llm.core.has_work()
    assert not any(r.num_pending for r in sched.active())


def _both(model: str, prompts: list[list[int]], params: list[SamplingParams], **kw: Any):
    """Generate the same batch with overlap off and on (two rounds each: the second round's
    prompts hit the prefix cache the first left); return both summaries and the engines."""
    results, engines = {}, {}
    for overlap in (False, True):
        llm = _llm(model, overlap, **kw)
        seen = _record_placeholders(llm)
        first = llm.generate(prompts, params)
        again = llm.generate([p + [7, 8] for p in prompts], params)
        results[overlap] = _summary(first) + _summary(again)
        engines[overlap] = llm
        _check_idle(llm)
        assert bool(seen) is overlap
    return results[False], results[True], engines[False], engines[True]


@pytest.mark.parametrize("which", ["llama", "mla"])
def test_overlap_greedy_equals_serial(which: str, request: pytest.FixtureRequest) -> None:
    if which == "mla":
        model = request.getfixturevalue("tiny_mla")("v2", moe=True, q_lora_rank=None)
    else:
        model = request.getfixturevalue("tiny_llama")
    prompts = _prompts(14)
    rng = random.Random(1)
    params = [
        SamplingParams(
            max_tokens=rng.randrange(2, 16), logprobs=i % 3 == 0, top_logprobs=i % 2, **GREEDY
        )
        for i in range(len(prompts))
    ]
    serial, overlap, a, b = _both(model, prompts, params)
    _assert_same(serial, overlap)
    for tokens, _, _, logprobs, _, ranks, tops in serial + overlap:
        # greedy: each token the most likely one, the first of its step's top tokens
        assert ranks is None or (logprobs is not None and ranks == [1] * len(tokens))
        assert tops is None or [top[0][0] for top in tops] == tokens
    for sched in (a.core.scheduler, b.core.scheduler):
        assert sched.counters.cache_hit_tokens > 0
        assert sched.counters.generation_tokens == sum(len(o[0]) for o in serial)
    # The tokens and KV of the wasted rows were dropped: the same prefix cache afterwards.
    assert a.core.scheduler.tree.total_size() == b.core.scheduler.tree.total_size()


@pytest.mark.parametrize("page_size", [1, 4])
def test_overlap_stops_late_and_drops_the_extra_token(tiny_llama: str, page_size: int) -> None:
    """Stop token ids, stop strings and min_tokens: a request whose stop is found in step n's
    tokens already has a row in step n+1; that row's token and KV are dropped."""
    prompts = _prompts(8, seed=3)
    plain = [SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY) for _ in prompts]
    reference = _llm(tiny_llama, False, page_size=page_size).generate(prompts, plain)
    params = []
    for i, ref in enumerate(reference):
        mid = ref.token_ids[3 + i % 5]
        if i % 3 == 0:  # a stop string from the middle of the text
            text = ref.text
            params.append(SamplingParams(max_tokens=24, stop=[text[len(text) // 2 :][:3]]))
        elif i % 3 == 1:  # a stop token, and min_tokens that suppresses its first occurrences
            params.append(SamplingParams(max_tokens=24, stop_token_ids=[mid], min_tokens=2))
        else:
            params.append(SamplingParams(max_tokens=24, stop_token_ids=[mid], ignore_eos=True))
        params[-1] = SamplingParams(**{**params[-1].__dict__, **GREEDY})
    serial, overlap, a, b = _both(tiny_llama, prompts, params, page_size=page_size)
    _assert_same(serial, overlap)
    assert sum(o[2] == "stop" for o in serial) >= len(prompts)  # both rounds mostly stop
    assert a.core.scheduler.tree.total_size() == b.core.scheduler.tree.total_size()


def test_overlap_seeded_sampling_and_penalties(tiny_mla) -> None:
    """Seeded draws depend only on their own generator; a repetition penalty reads the whole
    history on the host, so the engine processes the batch in flight before scheduling."""
    model = tiny_mla("v2", moe=True, q_lora_rank=None)
    prompts = _prompts(8, seed=5)
    params = [
        SamplingParams(
            max_tokens=12,
            temperature=0.9,
            top_p=0.9 if i % 2 else 1.0,
            top_k=20 if i % 3 else -1,
            seed=100 + i,
            repetition_penalty=1.3 if i % 4 == 1 else 1.0,
            presence_penalty=0.4 if i % 4 == 2 else 0.0,
            frequency_penalty=0.8 if i % 4 == 2 else 0.0,
            logprobs=True,
        )
        for i in range(len(prompts))
    ]
    serial, overlap, _, _ = _both(model, prompts, params)
    _assert_same(serial, overlap)


def test_overlap_with_retraction(tiny_llama: str) -> None:
    """A pool too small for everyone: decoding requests are retracted (some while their last
    token is still on the device) and recomputed."""
    prompts = _prompts(6, seed=7)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY) for _ in prompts]
    outs = {}
    for overlap in (False, True):
        llm = _llm(tiny_llama, overlap, max_total_tokens=200, max_running_requests=6)
        outs[overlap] = _summary(llm.generate(prompts, params))
        assert llm.core.scheduler.counters.retractions > 0
        _check_idle(llm)
    _assert_same(outs[False], outs[True])


def test_overlap_length_limit_takes_no_extra_step(tiny_llama: str) -> None:
    """A request that reaches max_tokens is not scheduled again; one that stops on a token
    found one step late costs one wasted decode step."""
    llm = _llm(tiny_llama, True)
    steps: list[str] = []
    launch = llm.core.runner.launch

    def counted(batch, sample_rows, requests):  # type: ignore[no-untyped-def]
        steps.append(batch.mode.value)
        return launch(batch, sample_rows, requests)

    llm.core.runner.launch = counted  # type: ignore[method-assign]
    prompt = _prompts(1, seed=9)[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY))[0]
    assert steps == ["extend"] + ["decode"] * 5
    steps.clear()
    stop = out.token_ids[3]
    stopped = llm.generate(
        prompt + [5], SamplingParams(max_tokens=20, stop_token_ids=[stop], **GREEDY)
    )[0]
    first = stopped.token_ids.index(stop) + 1 if stop in stopped.token_ids else 20
    assert len(stopped.token_ids) == first
    if first < 20:
        assert steps == ["extend"] + ["decode"] * first  # one more than the tokens it kept
    _check_idle(llm)


def _abort_run(model: str, overlap: bool) -> tuple[list[int], ...]:
    llm = _llm(model, overlap, max_total_tokens=512)
    core = llm.core
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    finished: dict[str, str | None] = {}

    def cb(delta: RequestOutput) -> None:
        got[delta.request_id] += delta.token_ids
        if delta.finished:
            finished[delta.request_id] = delta.finish_reason

    params = SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY)
    for i, rid in enumerate(got):
        core.add_request(rid, [500 + i * 50 + j for j in range(20)], params, cb)
    while len(got["b"]) < 5:
        core.step()
    core.abort("b")  # with overlap, its next step is in flight
    assert finished["b"] == "abort"
    core.scheduler.check_integrity()
    while core.has_work():
        core.step()
    assert finished == {"a": "length", "b": "abort", "c": "length"}
    assert len(got["b"]) == 5
    _check_idle(llm)
    return got["a"], got["b"], got["c"]


def test_overlap_abort_while_in_flight(tiny_mla) -> None:
    model = tiny_mla("v2", moe=True, q_lora_rank=None)
    assert _abort_run(model, False) == _abort_run(model, True)


@pytest.mark.cuda
@pytest.mark.parametrize("which", ["mla", "llama"])
def test_overlap_with_cuda_graphs_equals_serial(which: str, request: pytest.FixtureRequest) -> None:
    """On the GPU: graphs and overlap on against overlap off and against eager, greedy and
    seeded, with stop tokens found one step late."""
    if which == "mla":
        model = request.getfixturevalue("tiny_mla")("v2", moe=True, q_lora_rank=None)
    else:
        model = request.getfixturevalue("tiny_llama")
    prompts = _prompts(12, seed=11)
    common = dict(dtype="float32", attention_backend="triton", cuda_graph_max_bs=8)
    ref = LLM(model, max_total_tokens=2048, enable_cuda_graph=False, enable_overlap=False, **common)
    plain = [SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY) for _ in prompts]
    reference = ref.generate(prompts, plain)
    params = [
        SamplingParams(max_tokens=16, stop_token_ids=[r.token_ids[4 + i % 6]], **GREEDY)
        if i % 2
        else SamplingParams(max_tokens=16, temperature=0.8, seed=i, top_logprobs=i % 4)
        for i, r in enumerate(reference)
    ]
    results = {}
    for graphs, overlap in ((False, False), (True, False), (True, True)):
        llm = LLM(
            model,
            max_total_tokens=2048,
            max_running_requests=8,
            enable_cuda_graph=graphs,
            enable_overlap=overlap,
            debug_checks=True,
            **common,
        )
        assert llm.core.overlap is overlap
        outs = llm.generate(prompts, params)
        results[graphs, overlap] = [(o.token_ids, o.finish_reason) for o in outs]
        for p, o in zip(params, outs, strict=True):
            if p.top_logprobs:  # each step's top tokens, the chosen one among them by its rank
                assert o.top_logprobs is not None and o.logprob_ranks is not None
                assert [len(top) for top in o.top_logprobs] == [p.top_logprobs] * len(o.token_ids)
                for token, rank, top in zip(
                    o.token_ids, o.logprob_ranks, o.top_logprobs, strict=True
                ):
                    assert (rank <= len(top)) == (token in dict(top))
        if graphs:
            assert llm.core.runner.graph_runner is not None
            assert llm.core.runner.graph_runner.replays > 0
        _check_idle(llm)
        torch.cuda.synchronize()
    assert results[True, True] == results[True, False] == results[False, False]


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("which", ["mla", "llama"])
def test_overlap_decode_launch_does_not_synchronize(
    which: str, graphs: bool, request: pytest.FixtureRequest
) -> None:
    """Launching a decode step waits for nothing on the GPU (else the host could not run ahead):
    CUDA's sync debug mode turns any implicit synchronization into an error. Greedy, seeded
    top-k / top-p, min_tokens, logprobs and repetition-penalty rows; placeholder inputs."""
    if which == "mla":
        model = request.getfixturevalue("tiny_mla")("v2", moe=True, q_lora_rank=None)
    else:
        model = request.getfixturevalue("tiny_llama")
    llm = LLM(
        model,
        dtype="float32",
        attention_backend="triton",
        max_total_tokens=2048,
        enable_cuda_graph=graphs,
        cuda_graph_max_bs=8,
        enable_overlap=True,
    )
    launch = llm.core.runner.launch
    checked: list[bool] = []

    def strict(batch, sample_rows, requests):  # type: ignore[no-untyped-def]
        if batch.mode.value != "decode":
            return launch(batch, sample_rows, requests)
        placeholders = any(t < 0 for e in batch.entries for t in e.input_ids)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(batch, sample_rows, requests)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(placeholders)

    llm.core.runner.launch = strict  # type: ignore[method-assign]
    prompts = _prompts(5, seed=13)
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY),
        SamplingParams(max_tokens=8, temperature=0.7, top_k=20, top_p=0.9, seed=3),
        SamplingParams(max_tokens=8, min_tokens=4, logprobs=True, **GREEDY),
        SamplingParams(max_tokens=8, temperature=1.0, min_p=0.05, top_logprobs=3),
        SamplingParams(max_tokens=8, repetition_penalty=1.2, **GREEDY),
    ]
    for p in params:  # each kind alone (batches of one kind), then all together
        llm.generate(prompts[:2], p)
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 8 or o.finish_reason == "stop" for o in outs)
    assert checked and any(checked)
    if graphs:
        assert llm.core.runner.graph_runner is not None
        assert llm.core.runner.graph_runner.replays > 0
