"""Continuous batching, prefix sharing, retraction and abort, checked against solo runs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time

import numpy as np
import pytest

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParamsError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _mixed_prompts(n: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts with shared prefixes of several lengths, and mixed output lengths."""
    rng = random.Random(seed)
    stems = [[rng.randrange(100, 20000) for _ in range(k)] for k in (5, 40, 90)]
    prompts, params = [], []
    for i in range(n):
        stem = stems[i % len(stems)] if i % 4 else []
        prompts.append(stem + [rng.randrange(100, 20000) for _ in range(rng.randrange(1, 30))])
        params.append(SamplingParams(max_tokens=rng.randrange(4, 20), temperature=0.0))
    return prompts, params


def _check_idle(llm: LLM) -> None:
    sched = llm.core.scheduler
    sched.check_integrity()
    assert sched.in_use_slots() == 0
    assert sched.allocator.available_size() + sched.tree.total_size() == sched.allocator.size
    assert not llm.core.states
    assert not llm.core.families


@pytest.mark.parametrize("which,n", [("mla", 32), ("llama", 10)])
def test_batched_greedy_equals_solo(which: str, n: int, request: pytest.FixtureRequest) -> None:
    if which == "mla":
        model = request.getfixturevalue("tiny_mla")("v2", moe=True, q_lora_rank=None, yarn=True)
    else:
        model = request.getfixturevalue("default_model")
    prompts, params = _mixed_prompts(n)
    llm = LLM(
        model,
        dtype="float32",
        max_total_tokens=4096,
        max_running_requests=12,  # fewer than the requests: some wait, join between steps
        chunked_prefill_size=48,  # long prompts are prefilled in chunks
        debug_checks=True,
    )
    batched = llm.generate(prompts, params)
    solo_llm = LLM(model, dtype="float32", max_total_tokens=4096, disable_radix_cache=True)
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        solo = solo_llm.generate([prompt], p)[0]
        assert out.token_ids == solo.token_ids
        assert len(out.token_ids) == p.max_tokens or out.finish_reason == "stop"
    _check_idle(llm)
    stats = llm.core.stats()
    assert stats.prefix_cache_hit_tokens_total > 0
    assert stats.finished_total["length"] + stats.finished_total["stop"] == n


def test_shared_prefix_computes_only_new_tokens(default_model: str) -> None:
    llm = LLM(default_model, dtype="float32", max_total_tokens=4096, debug_checks=True)
    prefix = [random.Random(1).randrange(100, 20000) for _ in range(200)]
    first = llm.generate([prefix + [11, 12, 13]], GREEDY)[0]
    assert first.cached_tokens == 0
    counters = llm.core.scheduler.counters
    computed_before = counters.computed_prefill_tokens
    second = llm.generate([prefix + [21, 22, 23, 24]], GREEDY)[0]
    computed = counters.computed_prefill_tokens - computed_before
    assert second.cached_tokens == 200
    assert computed == 4  # only the new tokens went through the model
    assert llm.core.stats().prefix_cache_hit_tokens_total == 200
    solo = LLM(default_model, dtype="float32", max_total_tokens=4096, disable_radix_cache=True)
    assert second.token_ids == solo.generate([prefix + [21, 22, 23, 24]], GREEDY)[0].token_ids
    # One prompt given as numpy ids is one prompt, not a list of one-token prompts.
    (again,) = llm.generate(np.array(prefix + [21, 22, 23, 24]), GREEDY)
    assert again.token_ids == second.token_ids
    _check_idle(llm)


@pytest.mark.parametrize("page", [1, 16])
def test_small_pool_retracts_and_still_matches(tiny_mla, page: int) -> None:
    model = tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True)
    prompts = [[1000 + 37 * i + j for j in range(12)] for i in range(8)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    # 8 requests x 42 tokens need 336 slots (24 pages of 16); the pool has 128.
    llm = LLM(
        model,
        dtype="float32",
        page_size=page,
        max_total_tokens=128,
        max_running_requests=8,
        schedule_policy="fcfs",
        debug_checks=True,
    )
    outs = llm.generate(prompts, params)
    assert llm.core.scheduler.counters.retractions > 0
    solo = LLM(model, dtype="float32", max_total_tokens=256, disable_radix_cache=True)
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 30
        assert out.token_ids == solo.generate([prompt], params)[0].token_ids
    _check_idle(llm)


def test_abort_frees_slots_at_once(tiny_mla) -> None:
    model = tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True)
    llm = LLM(model, dtype="float32", max_total_tokens=512, debug_checks=True)
    core = llm.core
    finished: dict[str, str] = {}
    texts: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def cb(delta) -> None:
        texts[delta.request_id] += delta.token_ids
        if delta.finished:
            finished[delta.request_id] = delta.finish_reason

    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, rid in enumerate(texts):
        core.add_request(rid, [500 + i * 50 + j for j in range(20)], long, cb)
    while len(texts["b"]) < 5:
        core.step()
    req_b = core.states["b"].req
    own_slots = len(req_b.kv_slots) - sum(1 for _ in _path(req_b.last_node, core))
    in_use = core.scheduler.in_use_slots()
    free = core.scheduler.allocator.available_size() + core.scheduler.tree.evictable_size()
    core.abort("b")
    assert finished["b"] == "abort"
    assert core.scheduler.in_use_slots() == in_use - own_slots
    # Its computed tokens went to the prefix cache, unlocked: all of them can be reclaimed now.
    after = core.scheduler.allocator.available_size() + core.scheduler.tree.evictable_size()
    assert after == free + len(req_b.all_ids[: 20 + 5 - 1]) or after > free
    while core.has_work():
        core.step()
    assert finished == {"a": "length", "b": "abort", "c": "length"}
    assert len(texts["a"]) == len(texts["c"]) == 40
    _check_idle(llm)


def _path(node, core):
    tokens = []
    while node is not None and node is not core.scheduler.tree.root:
        tokens.extend(node.key)
        node = node.parent
    return tokens


def test_async_engine_streams_and_aborts(tiny_mla) -> None:
    model = tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True)
    engine = AsyncEngine(
        EngineConfig(model=model, dtype="float32", max_total_tokens=512, debug_checks=True)
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = [300 + j for j in range(15)]

    async def run() -> tuple[list[int], list, list[int]]:
        streamed: list[int] = []
        async for delta in engine.generate(prompt, params, "s1"):
            streamed += delta.token_ids
        # A consumer that stops early aborts its request.
        partial: list[int] = []
        gen = engine.generate(prompt, SamplingParams(max_tokens=500, ignore_eos=True), "s2")
        async for delta in gen:
            partial += delta.token_ids
            if len(partial) >= 3:
                break
        await gen.aclose()
        return streamed, [], partial

    try:
        streamed, _, partial = asyncio.run(run())
        offline = LLM(model, dtype="float32", max_total_tokens=512).generate([prompt], params)[0]
        assert streamed == offline.token_ids
        assert len(partial) >= 3
        for _ in range(100):  # the abort is processed by the loop thread
            if engine.stats().num_running == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert engine.stats().num_running == 0
        assert engine.stats().finished_total["abort"] == 1
    finally:
        engine.shutdown()


def test_async_engine_ends_requests_queued_just_before_shutdown(tiny_mla) -> None:
    """A request accepted right before `shutdown` still gets its one final delta (an error),
    and one added after it is refused: nothing waits forever."""
    model = tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True)
    for _ in range(3):
        engine = AsyncEngine(EngineConfig(model=model, dtype="float32", max_total_tokens=512))
        got: list[RequestOutput] = []
        engine.add_request("r1", [300, 301, 302], SamplingParams(max_tokens=4), got.append)
        engine.shutdown()
        assert [d.finished for d in got].count(True) == 1 and got[-1].error, got
        with pytest.raises(RuntimeError, match="shut down"):
            engine.add_request("r2", [300], SamplingParams(max_tokens=4), got.append)


def test_bad_requests_fail_before_queueing(tiny_mla) -> None:
    llm = LLM(
        tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True), dtype="float32", max_total_tokens=64
    )
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(SamplingParamsError, match="max_tokenz"):
        SamplingParams.from_dict({"max_tokenz": 3})
    with pytest.raises(ValueError, match="context limit is 64"):
        llm.generate([[5] * 10, [7] * 100], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10**9]], GREEDY)
    # A stop id past the vocabulary would fail the whole batch's sampling step (min_tokens
    # suppresses stop ids by indexing the logits), so it is refused alone, as a sampling
    # parameter (the server's message names `sampling_parameters`, not the prompt).
    bad_stop = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[99_999_999])
    with pytest.raises(SamplingParamsError, match="stop_token_ids: token id 99999999 is outside"):
        llm.generate([[5] * 10], bad_stop)
    assert not llm.core.has_work()  # nothing of the failed calls was queued
    assert llm.generate([[5] * 10], GREEDY)[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_mla) -> None:
    llm = LLM(
        tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True),
        dtype="float32",
        max_total_tokens=1024,
    )
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    alone = llm.generate([[9, 8, 7, 6]], seeded)[0].token_ids
    batched = llm.generate([[1, 2, 3], [9, 8, 7, 6], [4, 4]], [other, seeded, other])
    assert batched[1].token_ids == alone
    assert llm.generate([[9, 8, 7, 6]], seeded)[0].token_ids == alone


def test_stop_strings_and_logprobs(default_model: str) -> None:
    llm = LLM(default_model, dtype="float32", max_total_tokens=2048)
    prompt = "Count: one, two, three, four,"
    base = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    stop_word = base.text.strip().split(" ")[1]  # a word that appears mid-output
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0.0, stop=[stop_word], logprobs=True)
    )[0]
    assert out.finish_reason == "stop"
    assert stop_word not in out.text
    assert base.text.startswith(out.text)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert all(lp <= 0.0 for lp in out.logprobs)
    assert out.cumulative_logprob == pytest.approx(sum(out.logprobs), abs=1e-4)


def test_min_tokens_holds_back_eos(default_model: str) -> None:
    llm = LLM(default_model, dtype="float32", max_total_tokens=2048)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    short = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 12
    longer = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, min_tokens=12))
    assert len(longer[0].token_ids) >= 12
    eos = set(llm.core.eos_token_ids)
    assert not eos & set(longer[0].token_ids[:11])


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_error_fails_requests_in_flight_and_keeps_serving(tiny_mla, overlap: bool) -> None:
    """A step that raises fails the requests in flight and the engine serves the next one. With
    the overlap schedule, the step launched before the failing one still streams its token."""
    model = tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True)
    config = EngineConfig(
        model=model, dtype="float32", max_total_tokens=256, enable_overlap=overlap
    )
    engine = AsyncEngine(config)
    assert engine.core.overlap == overlap
    runner = engine.core.runner
    real_forward = runner.forward
    calls = {"n": 0}

    def flaky_forward(batch, all_logits=False):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_forward(batch, all_logits)

    runner.forward = flaky_forward  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def collect(rid: str, prompt: list[int]) -> list:
        return [d async for d in engine.generate(prompt, params, rid)]

    try:
        failed = asyncio.run(collect("boom", [400, 401, 402]))
        assert failed[-1].finished and failed[-1].finish_reason == "abort"
        assert "injected failure" in (failed[-1].error or "")
        produced = [t for d in failed for t in d.token_ids]
        assert len(produced) == 2  # the prefill's token and one decode step's
        # A prompt that runs through the failed step's token: its KV was never written, so the
        # prefix cache must not offer it.
        prompt = [400, 401, 402] + produced + [403]
        ok = asyncio.run(collect("after", prompt))
        assert ok[-1].finish_reason == "length"
        fresh = LLM(model, dtype="float32", max_total_tokens=256).generate([prompt], params)[0]
        assert [t for d in ok for t in d.token_ids] == fresh.token_ids
        engine.core.scheduler.check_integrity()
        assert engine.core.scheduler.in_use_slots() == 0
    finally:
        engine.shutdown()


def _failing_step(runner) -> None:  # type: ignore[no-untyped-def]
    def forward(batch, all_logits=False):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected failure")

    runner.forward = forward


@pytest.mark.parametrize("why", ["device", "bookkeeping"])
def test_engine_that_cannot_serve_again_ends_everything(tiny_llama: str, why: str) -> None:
    """A failed step after which the engine cannot serve (the GPU holds a sticky error, or
    ending the requests failed too) ends every request with one final output, stops
    accepting requests and calls `on_dead` once with the reason, instead of serving requests
    that can never finish."""
    died: list[str] = []
    engine = AsyncEngine(
        EngineConfig(model=tiny_llama, dtype="float32", max_total_tokens=256), died.append
    )
    core = engine.core
    _failing_step(core.runner)
    if why == "device":
        core.runner.device_error = lambda: "the GPU is in an error state (injected)"  # type: ignore[method-assign]
    else:
        real_finish = core.scheduler.finish
        calls = {"n": 0}

        def finish(req, reason, keep_kv=True):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 1:
                raise AssertionError("injected bookkeeping failure")
            return real_finish(req, reason, keep_kv)

        core.scheduler.finish = finish  # type: ignore[method-assign]
    outs: dict[str, list[RequestOutput]] = {"a": [], "b": []}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for rid in outs:
        engine.add_request(rid, [400 + len(rid), 401], params, outs[rid].append)
    try:
        engine._thread.join(10)
        assert not engine._thread.is_alive()
        expected = "GPU is in an error state" if why == "device" else "injected failure"
        assert len(died) == 1 and expected in died[0] and engine.dead == died[0]
        for rid, deltas in outs.items():
            finals = [d for d in deltas if d.finished]
            assert len(finals) == 1 and finals[0].finish_reason == "abort", rid
            assert "injected failure" in (finals[0].error or ""), rid
        assert not core.states
        with pytest.raises(RuntimeError, match="failed: "):
            engine.add_request("c", [400, 401], params, lambda d: None)
    finally:
        engine.shutdown()


def test_llm_generate_that_fails_leaves_nothing_behind(tiny_llama: str) -> None:
    """A step that raises inside `LLM.generate` ends its requests (their slots freed, the failed
    step's KV never cached), as the async engine does: the next call does not run them again
    on KV that was never written, and gives what a fresh engine gives."""
    llm = LLM(tiny_llama, dtype="float32", max_total_tokens=256)
    runner = llm.core.runner
    real_forward = runner.forward
    calls = {"n": 0}

    def flaky_forward(batch, all_logits=False):
        calls["n"] += 1
        if calls["n"] == 2:  # the first decode step
            raise RuntimeError("injected failure")
        return real_forward(batch, all_logits)

    runner.forward = flaky_forward  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[300, 301, 302, 303], [310, 311, 312]]
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(prompts, params)
    assert not llm.core.has_work()
    _check_idle(llm)
    outs = llm.generate(prompts, params)
    fresh_llm = LLM(tiny_llama, dtype="float32", max_total_tokens=256)
    fresh = fresh_llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fresh]
    # Prompts that run through the failed step's tokens: the prefix cache holds no KV for them
    # that was never written.
    longer = [p + o.token_ids for p, o in zip(prompts, fresh, strict=True)]
    assert [o.token_ids for o in llm.generate(longer, params)] == [
        o.token_ids for o in fresh_llm.generate(longer, params)
    ]
    _check_idle(llm)


@pytest.mark.parametrize(
    "which,backend", [("mla", "torch_native"), ("mla", "triton"), ("llama", "triton")]
)
def test_paged_pool_matches_page_size_1(
    which: str, backend: str, request: pytest.FixtureRequest
) -> None:
    """page_size 16: requests own whole pages; prefixes are shared in whole pages."""
    if which == "mla":
        model = request.getfixturevalue("tiny_mla")("v2", moe=True, q_lora_rank=None)
    else:
        model = request.getfixturevalue("tiny_llama")
    prompts, params = _mixed_prompts(8, seed=3)
    params = [dataclasses.replace(p, max_tokens=min(p.max_tokens, 8)) for p in params]
    paged = LLM(
        model,
        dtype="float32",
        page_size=16,
        attention_backend=backend,
        max_total_tokens=1024,
        max_running_requests=4,
        chunked_prefill_size=24,  # chunks that end inside a page
        debug_checks=True,
    )
    got = paged.generate(prompts, params)
    ref = LLM(model, dtype="float32", max_total_tokens=1024, disable_radix_cache=True)
    for prompt, p, out in zip(prompts, params, got, strict=True):
        assert out.token_ids == ref.generate([prompt], p)[0].token_ids
        assert out.cached_tokens % 16 == 0
    assert paged.core.stats().prefix_cache_hit_tokens_total > 0
    _check_idle(paged)


def test_token_ids_only_without_a_tokenizer(tiny_llama: str, tmp_path) -> None:
    """skip_tokenizer_init: a checkpoint with no tokenizer files serves token-id prompts and
    returns token ids (no text); text prompts and stop strings get clear errors."""
    from pathlib import Path

    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(Path(tiny_llama) / name)
    bare = LLM(str(tmp_path), dtype="float32", max_total_tokens=512, skip_tokenizer_init=True)
    full = LLM(tiny_llama, dtype="float32", max_total_tokens=512)
    prompts = [[5, 6, 7, 8], [300, 301]]
    outs = bare.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in full.generate(prompts, GREEDY)]
    assert all(o.text == "" and len(o.token_ids) == 12 for o in outs)
    with pytest.raises(ValueError, match="send the prompt as token ids"):
        bare.generate(["Hello"], GREEDY)
    with pytest.raises(ValueError, match="stop_token_ids"):
        bare.generate([[5, 6]], SamplingParams(max_tokens=4, stop=["x"]))
    assert not bare.core.has_work()
    engine = AsyncEngine(
        EngineConfig(
            model=str(tmp_path), dtype="float32", max_total_tokens=512, skip_tokenizer_init=True
        )
    )
    try:
        with pytest.raises(ValueError, match="token ids"):
            engine.add_request("t", "Hello", GREEDY, lambda d: None)
    finally:
        engine.shutdown()


def test_final_delta_carries_the_request_stages(tiny_llama: str) -> None:
    """RequestMetrics on the finished delta: arrival <= first scheduled <= first token <=
    finished; a request aborted before it was scheduled has neither of the middle two."""
    core = LLM(tiny_llama, dtype="float32", max_total_tokens=256).core
    finals: dict[str, RequestOutput] = {}

    def keep(out: RequestOutput) -> None:
        if out.finished:
            finals[out.request_id] = out

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    before = time.monotonic()
    core.add_request("run", [300 + j for j in range(9)], params, keep)
    core.add_request("gone", [400 + j for j in range(9)], params, keep)
    core.abort("gone")
    while core.has_work():
        core.step()
    after = time.monotonic()
    m = finals["run"].metrics
    assert m is not None and m.first_scheduled is not None and m.first_token is not None
    assert m.finished is not None
    assert before <= m.arrival <= m.first_scheduled <= m.first_token <= m.finished <= after
    assert m.queue_time is not None and m.prefill_time is not None
    # stepped at once: waiting is next to nothing, the prefill forward is not (it is stamped
    # into the prefill time, not the queue time, also where the launch runs it: on a CPU)
    assert m.prefill_time > m.queue_time
    gone = finals["gone"].metrics
    assert gone is not None and gone.first_scheduled is None and gone.first_token is None
    assert gone.queue_time is None and gone.prefill_time is None
    assert all(f.metrics is not None for f in finals.values())


def test_batch_log_lines(tiny_llama: str, caplog: pytest.LogCaptureFixture) -> None:
    """A line per prefill batch (requests, tokens) and one per decode_log_interval decode
    steps (running requests, rate); none with an interval of 0."""
    prompts = [[300 + j for j in range(9)], [400 + j for j in range(5)]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="engine.batch_log"):
        LLM(tiny_llama, dtype="float32", max_total_tokens=256, decode_log_interval=2).generate(
            prompts, params
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.batch_log"]
    prefill = [line for line in lines if line.startswith("prefill batch:")]
    decode = [line for line in lines if line.startswith("decode:")]
    assert prefill and prefill[0].startswith("prefill batch: 2 requests (2 new), 14 tokens")
    # 5 decode steps after the prefill (6 tokens each, the first from the prefill): lines at 2, 4
    assert len(decode) == 2 and all(line.startswith("decode: 2 running, ") for line in decode)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.batch_log"):
        LLM(tiny_llama, dtype="float32", max_total_tokens=256, decode_log_interval=0).generate(
            prompts, params
        )
    assert not [r for r in caplog.records if r.name == "engine.batch_log"]


def _failing_detokenizer(make):  # type: ignore[no-untyped-def]
    """An engine core's `_detokenizer` that raises for prompts starting with token 13."""

    def detokenizer(prompt_ids: list[int], params: SamplingParams):  # type: ignore[no-untyped-def]
        if prompt_ids[0] == 13:
            raise IndexError("piece id is out of range")
        return make(prompt_ids, params)

    return detokenizer


def test_a_request_that_fails_to_be_added_leaves_nothing_behind(tiny_mla) -> None:
    """Adding a request is all or nothing: one whose state cannot be built (here its
    detokenizer raises) gets its own error, and the scheduler never holds it (a request it
    schedules without a state failed every later step, and with it every other request)."""
    model = tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True)
    engine = AsyncEngine(EngineConfig(model=model, dtype="float32", max_total_tokens=512))
    engine.core._detokenizer = _failing_detokenizer(engine.core._detokenizer)  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def collect(rid: str, prompt: list[int]) -> list[RequestOutput]:
        return [d async for d in engine.generate(prompt, params, rid)]

    async def run() -> list[list[RequestOutput]]:
        prompts = {"a": [300, 301], "bad": [13, 14], "b": [302, 303]}
        every = asyncio.gather(*(collect(r, p) for r, p in prompts.items()))
        return await asyncio.wait_for(every, 60)  # (one never ended before the fix)

    try:
        good_a, bad, good_b = asyncio.run(run())
        assert bad[-1].finished and "piece id is out of range" in (bad[-1].error or ""), bad
        for got in (good_a, good_b):
            assert got[-1].error is None and got[-1].finish_reason == "length", got
            assert sum(len(d.token_ids) for d in got) == 4
        assert not engine.core.has_work() and "bad" not in engine.core.states
    finally:
        engine.shutdown()

    llm = LLM(model, dtype="float32", max_total_tokens=512)
    llm.core._detokenizer = _failing_detokenizer(llm.core._detokenizer)  # type: ignore[method-assign]
    with pytest.raises(IndexError):
        llm.generate([[300, 301], [13, 14]], params)
    assert not llm.core.has_work()  # the first one, added before, failed with it
    assert len(llm.generate([[300, 301]], params)[0].token_ids) == 4


def test_n_sequences_are_seeded_requests_of_their_own(tiny_mla) -> None:
    """`n` sequences of one prompt: each is the request with `seed + index` alone, reported in
    order of index; an unseeded request's sequences differ; greedy ones are the same."""
    llm = LLM(
        tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True),
        dtype="float32",
        max_total_tokens=1024,
        debug_checks=True,
    )
    prompt = [9, 8, 7, 6]
    seeded = SamplingParams(
        n=3, max_tokens=10, temperature=1.0, seed=50, ignore_eos=True, logprobs=True
    )
    outs = llm.generate([[1, 2], prompt], [SamplingParams(max_tokens=3), seeded])
    assert [(o.request_id == outs[1].request_id, o.index) for o in outs[1:]] == [
        (True, 0), (True, 1), (True, 2)
    ]  # fmt: skip
    assert outs[0].index == 0 and outs[0].request_id != outs[1].request_id
    for i, out in enumerate(outs[1:]):
        alone = llm.generate([prompt], seeded.for_sequence(i))[0]
        assert out.token_ids == alone.token_ids and out.finish_reason == "length"
        assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert out.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-4)
    free = SamplingParams(n=4, max_tokens=12, temperature=1.0, ignore_eos=True)
    assert len({tuple(o.token_ids) for o in llm.generate([prompt], free)}) > 1
    greedy = llm.generate([prompt], SamplingParams(n=2, max_tokens=6, temperature=0.0))
    assert greedy[0].token_ids == greedy[1].token_ids
    _check_idle(llm)


def test_n_sequences_stream_under_one_id_and_abort_together(tiny_mla) -> None:
    llm = LLM(
        tiny_mla("v2", moe=True, q_lora_rank=None, yarn=True),
        dtype="float32",
        max_total_tokens=1024,
        debug_checks=True,
    )
    core = llm.core
    got: list[RequestOutput] = []
    short = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
    core.add_request("r", [5, 6, 7], short, got.append)
    with pytest.raises(ValueError, match="'r' is already running"):
        core.add_request("r", [5], SamplingParams(), got.append)
    with pytest.raises(ValueError, match="the prompt is empty"):  # the scheduler refuses it
        core.add_request("e", [], short, got.append)
    assert "e" not in core.families and "e/0" not in core.states
    while core.has_work():
        core.step()
    assert {d.request_id for d in got} == {"r"}
    assert [d.finished for d in got].count(True) == 1 and got[-1].finished
    ends = [(d.index, d.finish_reason) for d in got if d.finish_reason is not None]
    assert sorted(ends) == [(0, "length"), (1, "length"), (2, "length")]
    for i in range(3):
        assert sum(len(d.token_ids) for d in got if d.index == i) == 4
    assert got[-1].metrics is not None and got[-1].metrics.first_token is not None
    assert all(d.metrics is None for d in got[:-1])

    got.clear()
    long = SamplingParams(n=2, max_tokens=200, ignore_eos=True)
    core.add_request("s", [5, 6, 7], long, got.append)
    for _ in range(3):
        core.step()
    core.abort("s")
    assert [d.finished for d in got].count(True) == 1 and got[-1].finished
    assert sorted(d.index for d in got if d.finish_reason == "abort") == [0, 1]
    assert not core.families and not core.has_work()

    got.clear()  # a failed step ends every sequence; the request's last delta has the error
    core.add_request("t", [5, 6, 7], long, got.append)
    core.step()
    assert core.fail_all("boom")
    assert [d.finished for d in got].count(True) == 1 and got[-1].error == "boom"
    assert all(d.error is None for d in got[:-1])
    assert sorted(d.index for d in got if d.finish_reason == "abort") == [0, 1]
    assert not core.families


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prefill_that_fails_after_its_launch_leaves_no_cached_prefix(
    tiny_llama: str, overlap: bool
) -> None:
    """A prefill chunk enters the prefix cache when its step is launched; if the step then fails
    (its ids never arrive), the cache must not offer that KV to the next request."""
    llm = LLM(tiny_llama, dtype="float32", max_total_tokens=1024, enable_overlap=overlap)
    core, runner = llm.core, llm.core.runner
    real_launch = runner.launch

    def launch_that_fails(batch, sample_rows, requests):  # type: ignore[no-untyped-def]
        step = real_launch(batch, sample_rows, requests)

        def result():  # type: ignore[no-untyped-def]
            raise RuntimeError("injected failure after launch")

        step.result = result
        return step

    runner.launch = launch_that_fails  # type: ignore[method-assign]
    prompt = list(range(300, 364))
    with pytest.raises(RuntimeError, match="after launch"):
        llm.generate([prompt], GREEDY)
    assert core.scheduler.tree.total_size() == 0
    runner.launch = real_launch  # type: ignore[method-assign]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.cached_tokens == 0 and again.finish_reason == "length"
    _check_idle(llm)
