"""The scheduler on its own: no model, no tensors; tokens come from a deterministic fake."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler.batch import ForwardMode
from engine.scheduler.request import Req, ReqStatus
from engine.scheduler.scheduler import Scheduler

GREEDY3 = SamplingParams(max_tokens=3, temperature=0.0)


def _fake_token(req: Req) -> int:
    """A token that depends only on the request's tokens so far, like greedy decoding."""
    return (sum(req.all_ids) * 31 + len(req.all_ids)) % 1000


def _run(
    sched: Scheduler, reqs: list[Req], rng: random.Random | None = None, abort_p: float = 0.0
) -> dict[str, list[int]]:
    for r in reqs:
        sched.add_request(r)
    outputs: dict[str, list[int]] = {}
    steps = 0
    while sched.has_work():
        out = sched.schedule()
        assert out is not None, "work is queued but nothing can be scheduled"
        p = sched.allocator.page_size
        for e in out.batch.entries:
            assert len(e.out_cache_loc) == len(e.input_ids)
            assert min(e.out_cache_loc) >= p  # the padding page is never handed out
            # Token i of a request sits at offset i % p of one of its pages.
            for i, slot in enumerate(e.out_cache_loc, start=e.prefix_len):
                assert slot % p == i % p
        if out.batch.mode == ForwardMode.DECODE:
            assert all(len(e.input_ids) == 1 for e in out.batch.entries)
        next_ids = {row: _fake_token(out.reqs[row]) for row in out.sample_rows}
        for req in sched.process_batch(out, next_ids):
            # The engine's length rule: max_tokens, or the context limit.
            limit = len(req.output_ids) >= req.params.max_tokens
            if limit or len(req.all_ids) >= sched.max_context_len:
                sched.finish(req, "length")
                outputs[req.rid] = list(req.output_ids)
        if rng is not None and rng.random() < abort_p:
            live = [r for r in reqs if not r.finished]
            if live:
                victim = rng.choice(live)
                sched.finish(victim, "abort")
                outputs[victim.rid] = []
        sched.check_integrity()
        steps += 1
        assert steps < 10_000
    assert sched.in_use_slots() == 0
    assert sched.allocator.available_size() + sched.tree.total_size() == sched.allocator.size
    assert len(sched.free_rows) == sched.max_running
    return outputs


def _reqs(rng: random.Random, n: int, shared: list[int]) -> list[Req]:
    out = []
    for i in range(n):
        prompt = shared[: rng.randrange(0, len(shared))] + [
            rng.randrange(1, 1000) for _ in range(rng.randrange(1, 20))
        ]
        params = SamplingParams(max_tokens=rng.randrange(1, 25), temperature=0.0)
        out.append(Req(rid=f"r{i}", prompt_ids=prompt, params=params, arrival=0))
    return out


def _expected(req: Req, max_context_len: int) -> list[int]:
    solo = Req(rid="solo", prompt_ids=list(req.prompt_ids), params=req.params, arrival=0)
    while len(solo.output_ids) < req.params.max_tokens and len(solo.all_ids) < max_context_len:
        solo.output_ids.append(_fake_token(solo))
    return solo.output_ids


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
@pytest.mark.parametrize("pool,chunk", [(512, 2048), (96, 16), (60, 7)])
def test_random_workloads_keep_the_invariant(policy: str, pool: int, chunk: int, page: int) -> None:
    rng = random.Random(pool * 7 + chunk)
    shared = [rng.randrange(1, 1000) for _ in range(30)]
    config = EngineConfig(chunked_prefill_size=chunk, schedule_policy=policy, page_size=page)
    sched = Scheduler(config, max_total_tokens=pool, max_context_len=pool, max_running=6)
    reqs = _reqs(rng, 40, shared)
    outputs = _run(sched, reqs)
    for r in reqs:
        assert r.status == ReqStatus.FINISHED
        assert outputs[r.rid] == _expected(
            r, pool
        )  # retraction and chunking never change the result
    if pool < 100:
        assert sched.counters.retractions > 0
    assert sched.counters.cache_hit_tokens > 0


@pytest.mark.parametrize("page", [1, 4])
def test_aborts_at_random_points_leak_nothing(page: int) -> None:
    rng = random.Random(5)
    shared = [rng.randrange(1, 1000) for _ in range(30)]
    config = EngineConfig(chunked_prefill_size=8, page_size=page)
    sched = Scheduler(config, max_total_tokens=80, max_context_len=80, max_running=5)
    reqs = _reqs(rng, 30, shared)
    _run(sched, reqs, rng=rng, abort_p=0.15)
    assert all(r.finished for r in reqs)
    assert any(r.finish_reason == "abort" for r in reqs)


def test_admission_respects_the_running_cap_and_chunk_budget() -> None:
    config = EngineConfig(chunked_prefill_size=10)
    sched = Scheduler(config, max_total_tokens=200, max_context_len=200, max_running=2)
    for i in range(3):
        params = SamplingParams(max_tokens=3)
        sched.add_request(Req(rid=f"r{i}", prompt_ids=list(range(1, 16)), params=params, arrival=0))
    out = sched.schedule()
    assert out is not None and out.batch.mode == ForwardMode.EXTEND
    assert out.batch.num_tokens == 10  # the budget: one request's first chunk
    assert out.sample_rows == []  # its prompt is not complete yet
    sched.process_batch(out, {})
    out = sched.schedule()
    assert out is not None
    # The chunked request finishes its prompt (5 tokens) and the second starts (5 of budget).
    assert [len(e.input_ids) for e in out.batch.entries] == [5, 5]
    assert sched.num_running == 2 and len(sched.waiting) == 1


def test_prompt_at_the_context_limit_is_rejected() -> None:
    sched = Scheduler(EngineConfig(), max_total_tokens=64, max_context_len=32, max_running=2)
    with pytest.raises(ValueError, match="context limit is 32"):
        sched.add_request(Req(rid="x", prompt_ids=[1] * 32, params=SamplingParams(), arrival=0))
    assert not sched.has_work()


def test_long_prompt_shares_steps_with_decoding_requests() -> None:
    """Beside decoding requests, a long prompt's prefill alternates with decode steps and its
    chunks shrink to about one decode step's time; short prompts go before its chunks."""
    config = EngineConfig(model="unused", chunked_prefill_size=512, schedule_policy="fcfs")
    sched = Scheduler(config, 8192, 4096, 8)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    sched.add_request(Req("short0", [1, 2, 3], params, 0))
    out = sched.schedule()
    assert out is not None and out.batch.mode == ForwardMode.EXTEND
    sched.process_batch(out, {0: 7})
    sched.record_step(out, 0.03)  # 3 tokens: 10 ms per prefill token
    assert sched.prefill_budget() == 512  # no decode time measured yet
    sched.add_request(Req("long", list(range(10, 3010)), params, 0))
    sched.add_request(Req("short1", [4, 5], params, 0))
    modes, chunks = [], []
    for _ in range(8):
        out = sched.schedule()
        assert out is not None
        modes.append(out.batch.mode)
        if out.batch.mode == ForwardMode.EXTEND:
            chunks.append(
                {r.rid: len(e.input_ids) for r, e in zip(out.reqs, out.batch.entries, strict=True)}
            )
        sched.process_batch(out, {row: 7 for row in out.sample_rows})
        sched.record_step(
            out, 0.5 if out.batch.mode == ForwardMode.DECODE else 0.01 * out.batch.num_tokens
        )
    # short0 decodes first (the last step was a prefill), then prefill and decode alternate;
    # a prefill step takes 0.5 s / 10 ms = 50 tokens, the short prompt before the long chunk.
    assert modes == [ForwardMode.DECODE, ForwardMode.EXTEND] * 4
    assert chunks[0] == {"short1": 2, "long": 48}
    assert all(c == {"long": 50} for c in chunks[1:])
    # GPU-like times (10 ms decode steps, 20 us per prefill token): a prefill step may take
    # PREFILL_STALL_S, so chunks stay whole.
    for _ in range(20):
        out = sched.schedule()
        assert out is not None
        sched.process_batch(out, {row: 7 for row in out.sample_rows})
        gpu_s = 0.01 if out.batch.mode == ForwardMode.DECODE else 2e-5 * out.batch.num_tokens
        sched.record_step(out, gpu_s)
    assert sched.prefill_budget() == 512
    sched.check_integrity()


def test_scheduled_batch_round_trips_through_bytes() -> None:
    """What tensor-parallel workers receive each step: the same batch, from one flat buffer."""
    from engine.scheduler.batch import BatchEntry, ScheduledBatch

    batch = ScheduledBatch(
        ForwardMode.EXTEND,
        [
            BatchEntry(3, [11, 12, 13], 5, [40, 41, 42], prefix_slots=[1, 2, 3, 4, 5]),
            BatchEntry(0, [7], 0, [9]),
            BatchEntry(1, [8, 9], 2, [30, 31], prefix_slots=[]),
        ],
    )
    assert ScheduledBatch.from_bytes(batch.to_bytes(all_logits=True)) == (batch, True)
    decode = ScheduledBatch(ForwardMode.DECODE, [BatchEntry(2, [5], 9, [99])])
    assert ScheduledBatch.from_bytes(decode.to_bytes()) == (decode, False)
    assert len(decode.to_bytes()) == 8 * (3 + 4 + 2)


def _fake_from(ids: list[int]) -> int:
    return (sum(ids) * 31 + len(ids)) % 1000


def _drive(sched: Scheduler, reqs: list[Req], overlap: bool) -> dict[str, list[int]]:
    """The engine's loop with the overlap schedule (or without): a batch's tokens are processed
    after the next batch is launched. The fake device resolves placeholder ids from the values
    it sampled in the step before, as the model runner does; a token divisible by 7 stops its
    request (found one step late with overlap)."""
    for r in reqs:
        sched.add_request(r)
    outputs: dict[str, list[int]] = {}
    device_ids: list[int] = []  # what the latest launched step sampled
    previous = None
    for _ in range(10_000):
        if not sched.has_work() and previous is None:
            break
        out = sched.schedule()
        launched = None
        if out is not None:
            next_ids = {}
            for row in out.sample_rows:
                ids = [device_ids[-t - 1] if t < 0 else t for t in out.reqs[row].all_ids]
                next_ids[row] = _fake_from(ids)
            sched.on_batch_launched(out)
            device_ids = [next_ids[row] for row in out.sample_rows]
            launched = (out, next_ids)
        done = previous if overlap else launched
        previous = launched if overlap else None
        if done is not None:
            for req in sched.resolve_tokens(*done):
                token = req.output_ids[req.num_known_outputs - 1]
                if token % 7 == 0:
                    sched.finish(req, "stop")
                elif req.reaches_length_limit(req.num_known_outputs, sched.max_context_len):
                    sched.finish(req, "length")
                if req.finished:
                    outputs[req.rid] = list(req.output_ids)
        sched.check_integrity()
    assert not sched.has_work() and previous is None
    assert sched.in_use_slots() == 0
    assert sched.allocator.available_size() + sched.tree.total_size() == sched.allocator.size
    return outputs


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("pool,chunk", [(512, 2048), (96, 16), (60, 7)])
def test_overlap_schedule_gives_the_same_outputs(pool: int, chunk: int, page: int) -> None:
    """Placeholders, late stops and retraction with a launched step in flight: the outputs,
    and the prefix cache left behind, are those of the serial loop."""
    results, trees = [], []
    for overlap in (False, True):
        rng = random.Random(pool + chunk)
        shared = [rng.randrange(1, 1000) for _ in range(30)]
        config = EngineConfig(chunked_prefill_size=chunk, page_size=page)
        sched = Scheduler(config, max_total_tokens=pool, max_context_len=pool, max_running=6)
        results.append(_drive(sched, _reqs(rng, 40, shared), overlap))
        trees.append(sched.tree.total_size())
        if pool < 100:
            assert sched.counters.retractions > 0
    assert results[0] == results[1]
    assert any(len(v) < 24 for v in results[0].values())  # some stopped on a token
    if pool == 512:  # nothing evicted: the extra tokens' KV never reached the tree
        assert trees[0] == trees[1]


def test_prefill_cost_splits_fixed_and_per_token() -> None:
    """A line through the recent steps: fixed + per_token * tokens, older steps weighed down."""
    from engine.scheduler.step_cost import PrefillCost

    cost = PrefillCost()
    assert cost.fit() is None and cost.budget(0.1, 2048, 32) == 2048
    for n in (512, 1024, 2048, 256, 512):
        cost.add(n, 0.02 + 1e-5 * n)
    fit = cost.fit()
    assert fit is not None
    assert fit[0] == pytest.approx(0.02) and fit[1] == pytest.approx(1e-5)
    assert cost.budget(0.05, 8192, 32) == 3000  # (0.05 - 0.02) / 1e-5
    assert cost.budget(0.01, 8192, 32) == 32  # the fixed cost alone is over the limit
    # Host-bound steps: no cost per token to speak of, so whole chunks fit the limit.
    flat = PrefillCost()
    for n in (1, 32, 512, 2048):
        flat.add(n, 0.025 + (0.001 if n == 32 else 0.0))
    assert flat.budget(0.1, 2048, 32) == 2048


def test_prompts_after_cached_prompts_keep_whole_chunks() -> None:
    """The H200 serving run that cut prompts into 32-token chunks: after 1-token prefills (the
    rest of each prompt cached) of 25 ms each, a 512-token prompt beside decoding requests must
    not be sliced by a cost of 25 ms per token. Step times are the eager GPU forward's: 25 ms
    fixed plus 4 us a token; decode steps 8 ms."""
    config = EngineConfig(model="unused", chunked_prefill_size=2048, schedule_policy="fcfs")
    sched = Scheduler(config, 1 << 16, 4096, 32)
    params = SamplingParams(max_tokens=1000, ignore_eos=True)

    def run(steps: int) -> list[int]:
        sizes = []
        for _ in range(steps):
            out = sched.schedule()
            assert out is not None
            sched.process_batch(out, {row: 7 for row in out.sample_rows})
            if out.batch.mode == ForwardMode.DECODE:
                sched.record_step(out, 0.008)
            else:
                sizes.append(out.batch.num_tokens)
                sched.record_step(out, 0.025 + 4e-6 * out.batch.num_tokens)
        return sizes

    for i in range(4):  # 1-token prefills (what a cached prompt costs), decoding beside
        sched.add_request(Req(f"cached{i}", [5], params, 0))
        run(2)
    for i in range(8):
        sched.add_request(Req(f"new{i}", list(range(100 + 512 * i, 612 + 512 * i)), params, 0))
    sizes = run(12)
    # At most one exploring step below a whole prompt, then every step takes whole prompts.
    assert sum(s < 512 for s in sizes) <= 1, sizes
    assert sum(sizes) == 8 * 512
    sched.check_integrity()


def test_batch_log_shows_the_prefill_budget_and_its_fit() -> None:
    """The prefill line's tail: nothing while nothing decodes, "one size" before two sizes, then
    the fitted fixed and per-token cost beside the budget they give."""
    from engine.batch_log import _budget

    config = EngineConfig(model="unused", chunked_prefill_size=2048, schedule_policy="fcfs")
    sched = Scheduler(config, 1 << 16, 4096, 32)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    assert _budget(sched) == ""
    for i, n in enumerate((512, 64)):
        sched.add_request(Req(f"r{i}", list(range(10, 10 + n)), params, 0))
        out = sched.schedule()
        assert out is not None and out.batch.mode == ForwardMode.EXTEND
        sched.process_batch(out, {row: 7 for row in out.sample_rows})
        sched.record_step(out, 0.025 + 4e-6 * out.batch.num_tokens)
        if i == 0:
            assert _budget(sched) == "; budget 2048 (one size)"  # no decode step timed yet
            out = sched.schedule()
            assert out is not None and out.batch.mode == ForwardMode.DECODE
            sched.process_batch(out, {row: 7 for row in out.sample_rows})
            sched.record_step(out, 0.008)
    # 25 ms + 4 us a token; (0.1 s - 25 ms) / 4 us = 18,750 tokens, capped at the chunk size
    assert _budget(sched) == "; budget 2048 (fit 25.0 ms + 4.0 us/token)"


def test_overlap_waits_for_a_finishing_request_to_free_its_slots() -> None:
    """Overlap schedule, a full pool: r1 ends with the token in flight, r2 needs a slot. The
    next step is empty (r1's slots free once its token is processed), not a failure."""
    sched = Scheduler(EngineConfig(), max_total_tokens=7, max_context_len=7, max_running=4)
    sched.add_request(Req("r1", [1, 2, 3, 4], SamplingParams(max_tokens=1), 0))
    sched.add_request(Req("r2", [5, 6, 7], SamplingParams(max_tokens=3), 0))
    out = sched.schedule()
    assert out is not None and sched.allocator.available_size() == 0
    sched.on_batch_launched(out)
    assert sched.schedule() is None


def test_prefill_goes_on_when_a_new_request_finds_no_page() -> None:
    """Pages of 4, 16 slots, 1-token chunks: a long prompt's next chunk needs no new page (its
    last has room) while a newly arrived short prompt needs one. The long prompt goes on (the
    short one waits, not admitted), then the short one runs: no step without work."""
    sched = Scheduler(
        EngineConfig(page_size=4, chunked_prefill_size=1), max_total_tokens=16,
        max_context_len=16, max_running=4,
    )  # fmt: skip
    sched.add_request(Req("long", list(range(100, 115)), SamplingParams(max_tokens=1), 0))
    for _ in range(13):  # 13 one-token chunks: 4 pages held, the last one a quarter used
        out = sched.schedule()
        assert out is not None
        sched.process_batch(out, {})
    sched.add_request(Req("short", [7], SamplingParams(max_tokens=1), 0))
    done = []
    for _ in range(10):
        out = sched.schedule()
        assert out is not None, "work queued, nothing schedulable"
        for req in sched.process_batch(out, dict.fromkeys(out.sample_rows, 1)):
            sched.finish(req, "length")
            done.append(req.rid)
        if not sched.has_work():
            break
    assert done == ["long", "short"]
    sched.check_integrity()
    assert sched.allocator.available_size() + sched.tree.total_size() == sched.allocator.size


def test_a_partly_prefilled_prompt_is_not_starved_by_short_ones() -> None:
    """Prompts that fit the budget go before a long prompt's chunks, but a long prompt left
    out of PREFILL_MAX_SKIPS prefill steps in a row gets the next one."""
    from engine.scheduler.scheduler import PREFILL_MAX_SKIPS

    sched = Scheduler(
        EngineConfig(chunked_prefill_size=16), max_total_tokens=4096, max_context_len=4096,
        max_running=8,
    )  # fmt: skip
    sched.add_request(Req("long", list(range(1000, 1100)), SamplingParams(max_tokens=4), 0))
    out = sched.schedule()
    assert out is not None
    sched.process_batch(out, {})
    long = sched.prefilling[0]
    chunks = []
    for step in range(3 * (PREFILL_MAX_SKIPS + 1)):
        sched.add_request(Req(f"s{step}", [step + 1] * 16, SamplingParams(max_tokens=1), 0))
        out = sched.schedule()
        assert out is not None
        chunks.append(long in out.reqs)
        for req in sched.process_batch(out, dict.fromkeys(out.sample_rows, 5)):
            sched.finish(req, "length")
    assert chunks.count(True) == 3 and chunks[PREFILL_MAX_SKIPS], chunks


def test_a_small_chunked_prefill_size_holds_beside_decoding() -> None:
    """chunked_prefill_size below MIN_PREFILL_TOKENS caps a prefill step beside decoding
    requests too (the floor does not lift it)."""
    sched = Scheduler(
        EngineConfig(chunked_prefill_size=8), max_total_tokens=1000, max_context_len=1000,
        max_running=4,
    )  # fmt: skip
    sched.add_request(Req("a", [1, 2, 3], SamplingParams(max_tokens=50), 0))
    out = sched.schedule()
    assert out is not None
    sched.record_step(out, 0.5)
    sched.process_batch(out, {0: 5})
    out = sched.schedule()  # a decode step
    assert out is not None and out.batch.mode == ForwardMode.DECODE
    sched.record_step(out, 0.01)
    sched.process_batch(out, {0: 6})
    sched.add_request(Req("b", list(range(10, 110)), SamplingParams(max_tokens=5), 0))
    out = sched.schedule()
    assert out is not None and out.batch.mode == ForwardMode.EXTEND
    assert out.batch.num_tokens == 8


def test_a_request_that_cannot_fit_leaves_the_cache_alone() -> None:
    """A prompt that would not fit even with every cached prefix evicted waits without
    evicting them (they still serve the requests that match them)."""
    sched = Scheduler(EngineConfig(), max_total_tokens=64, max_context_len=64, max_running=4)
    sched.add_request(Req("a", list(range(1, 21)), SamplingParams(max_tokens=1), 0))
    out = sched.schedule()
    assert out is not None
    for req in sched.process_batch(out, dict.fromkeys(out.sample_rows, 5)):
        sched.finish(req, "length")
    cached = sched.tree.evictable_size()
    assert cached >= 20
    sched.add_request(Req("b", list(range(100, 140)), SamplingParams(max_tokens=30), 0))
    sched.add_request(Req("c", list(range(200, 250)), SamplingParams(max_tokens=1), 0))
    out = sched.schedule()  # b runs; c (50 tokens) cannot fit beside it even with a evicted
    assert out is not None and [r.rid for r in out.reqs] == ["b"]
    assert sched.tree.evictable_size() + sched.tree.protected_size() >= cached


def test_a_waiting_long_prompt_is_not_starved_by_later_short_ones() -> None:
    """All rows busy and a short prompt arriving every step: a long prompt queued before them
    (not admitted yet, so not partly prefilled) still gets a row within PREFILL_MAX_SKIPS
    prefill steps and a few more, instead of every later short prompt going first."""
    from engine.scheduler.scheduler import PREFILL_MAX_SKIPS

    sched = Scheduler(
        EngineConfig(chunked_prefill_size=16, schedule_policy="fcfs"), max_total_tokens=4096,
        max_context_len=4096, max_running=2,
    )  # fmt: skip
    sched.add_request(Req("first", [1] * 8, SamplingParams(max_tokens=3), 0))
    sched.add_request(Req("long", list(range(1000, 1100)), SamplingParams(max_tokens=1), 0))
    long_done = None
    for step in range(6 * (PREFILL_MAX_SKIPS + 1)):
        sched.add_request(Req(f"s{step}", [step % 50 + 2] * 8, SamplingParams(max_tokens=3), 0))
        out = sched.schedule()
        assert out is not None
        for req in sched.process_batch(out, dict.fromkeys(out.sample_rows, 5)):
            if req.reaches_length_limit(len(req.output_ids), sched.max_context_len):
                sched.finish(req, "length")
                if req.rid == "long":
                    long_done = step
        sched.check_integrity()
    assert long_done is not None, "the long prompt never ran"


def _step(sched: Scheduler) -> list[str]:
    """One step with fake tokens; the ids of the requests it ran."""
    out = sched.schedule()
    assert out is not None
    sched.process_batch(out, dict.fromkeys(out.sample_rows, 5))
    return [r.rid for r in out.reqs]


def test_a_mostly_cached_prompt_goes_before_a_long_prompts_chunks() -> None:
    """A follow-up turn whose history is cached needs few new tokens: it counts as short
    (its cached prefix as matched when the queue was ordered) and is prefilled in the next
    prefill step, not after every chunk of a long prompt prefilling beside it."""
    sched = Scheduler(
        EngineConfig(chunked_prefill_size=512, schedule_policy="lpm"), max_total_tokens=100_000,
        max_context_len=100_000, max_running=16,
    )  # fmt: skip
    history = list(range(1000, 5000))
    first = Req("turn1", history, SamplingParams(max_tokens=400, ignore_eos=True), 0)
    sched.add_request(first)
    while sched.waiting or sched.prefilling:
        _step(sched)
    sched.finish(first, "stop")  # its KV is cached now
    sched.add_request(Req("decoder", [7] * 20, SamplingParams(max_tokens=400), 0))
    _step(sched)
    sched.add_request(Req("long", list(range(20_000, 28_000)), SamplingParams(max_tokens=4), 0))
    _step(sched)
    _step(sched)
    follow = Req("turn2", history + [5] + [9] * 10, SamplingParams(max_tokens=4), 0)
    sched.add_request(follow)
    ran = [_step(sched) for _ in range(2)]  # a decode step and a prefill step, in some order
    assert "turn2" in ran[0] + ran[1], ran
    assert follow.cached_tokens == 4000
    sched.check_integrity()


def test_no_prefix_matching_while_no_request_can_be_admitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every row busy, ordering the queue by cached prefix (lpm) would cost host time on
    every decode step for nothing: the queue is not matched until a row frees."""
    sched = Scheduler(
        EngineConfig(schedule_policy="lpm"), max_total_tokens=10_000, max_context_len=10_000,
        max_running=2,
    )  # fmt: skip
    for i in range(2):
        sched.add_request(Req(f"d{i}", [i + 1] * 8, SamplingParams(max_tokens=6), 0))
    _step(sched)
    for i in range(4):
        sched.add_request(Req(f"w{i}", [i + 10] * 40, SamplingParams(max_tokens=1), 0))
    matched: list[int] = []
    real = sched.tree.match_prefix
    monkeypatch.setattr(sched.tree, "match_prefix", lambda key: matched.append(1) or real(key))
    for _ in range(3):
        assert _step(sched) == ["d0", "d1"]
    assert not matched
    for req in list(sched.running):
        sched.finish(req, "length")
    assert _step(sched)[:2] == ["w0", "w1"]
    assert matched  # ordered (and admitted) once rows are free


@pytest.mark.parametrize("page", [1, 16])
def test_prompts_sharing_an_uncached_head_compute_it_once(page: int) -> None:
    """Requests waiting behind one that computes the same uncached tokens in this prefill step
    (the sequences of an n > 1 request, a burst behind one system prompt) wait for the next
    step and take those tokens from the cache; a short shared head does not hold them back."""
    system = [(7 * i) % 997 + 1 for i in range(300)]
    same = [Req(rid=f"n{i}", prompt_ids=list(system), params=GREEDY3, arrival=0) for i in range(4)]
    tails = [
        Req(rid=f"t{i}", prompt_ids=system + [500 + i, 600 + i], params=GREEDY3, arrival=0)
        for i in range(3)
    ]
    short = [Req(rid=f"s{i}", prompt_ids=system[:20] + [i + 1], params=GREEDY3, arrival=0)
             for i in range(2)]  # fmt: skip
    config = EngineConfig(chunked_prefill_size=128, page_size=page)
    sched = Scheduler(config, max_total_tokens=4096, max_context_len=4096, max_running=16)
    reqs = same + tails + short
    outputs = _run(sched, reqs)
    for r in reqs:
        assert outputs[r.rid] == _expected(r, 4096)
    # The system prompt once (in chunks of 128), then each other prompt's own tokens: at
    # most a page of the shared part again (a match ends at a whole page) and its tail.
    own = sum(len(r.prompt_ids) - len(system) + 1 for r in same[1:] + tails)
    short_own = sum(len(r.prompt_ids) for r in short)  # (20 shared tokens: under the check)
    assert sched.counters.computed_prefill_tokens <= len(system) + own + short_own + 6 * (page - 1)
    assert sched.counters.cache_hit_tokens >= 6 * (len(system) - page)


def test_in_batch_prefix_waits_only_with_the_radix_cache() -> None:
    system = [(3 * i) % 991 + 1 for i in range(100)]
    config = EngineConfig(chunked_prefill_size=1024, disable_radix_cache=True)
    sched = Scheduler(config, max_total_tokens=4096, max_context_len=4096, max_running=8)
    for i in range(3):
        sched.add_request(Req(rid=f"r{i}", prompt_ids=list(system), params=GREEDY3, arrival=0))
    out = sched.schedule()
    assert out is not None and len(out.reqs) == 3  # nothing to wait for without a cache


def test_in_batch_prefix_needs_the_same_head_before_the_window() -> None:
    """A request that matches a computing request's window at the same positions but not the
    tokens before it (another cached head of the same length) does not wait for it."""
    config = EngineConfig(chunked_prefill_size=1024, schedule_policy="fcfs")
    sched = Scheduler(config, max_total_tokens=4096, max_context_len=4096, max_running=8)
    head, other_head, doc = (
        list(range(1000, 1040)),
        list(range(2000, 2010)),
        list(range(3000, 3064)),
    )
    warm = Req(rid="warm", prompt_ids=head, params=GREEDY3, arrival=0)
    sched.add_request(warm)
    out = sched.schedule()
    assert out is not None
    sched.process_batch(out, dict.fromkeys(out.sample_rows, 5))
    sched.finish(warm, "length")  # head is cached now
    sched.add_request(Req(rid="e", prompt_ids=other_head + doc, params=GREEDY3, arrival=0))
    sched.add_request(Req(rid="a", prompt_ids=head[:10] + doc, params=GREEDY3, arrival=0))
    out = sched.schedule()
    assert out is not None and [r.rid for r in out.reqs] == ["e", "a"]
