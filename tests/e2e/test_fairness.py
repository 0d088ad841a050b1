"""One long prompt must not starve short requests (issue 15): 100 short requests beside one
6,000-token request finish within 3x their time alone. CPU, the default model; minutes long, so
it runs in `make soak`."""

from __future__ import annotations

import random
import threading
import time

import pytest

from engine import AsyncEngine, EngineConfig, RequestOutput, SamplingParams

SHORT = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _run_shorts(engine: AsyncEngine, shorts: list[list[int]], long: list[int] | None) -> float:
    """Seconds until every short request finished (the long one, if any, submitted first)."""
    left = {f"s{i}" for i in range(len(shorts))}
    done = threading.Event()
    t0 = time.perf_counter()
    finished_at: list[float] = []

    def on_delta(delta: RequestOutput) -> None:
        if delta.finished and delta.request_id in left:
            assert delta.finish_reason == "length", delta
            left.discard(delta.request_id)
            if not left:
                finished_at.append(time.perf_counter() - t0)
                done.set()

    if long is not None:
        long_params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        engine.add_request("long", long, long_params, lambda d: None)
    for i, prompt in enumerate(shorts):
        engine.add_request(f"s{i}", prompt, SHORT, on_delta)
    assert done.wait(1800), f"{len(left)} short requests never finished"
    return finished_at[0]


@pytest.mark.soak
def test_short_requests_beside_a_long_prompt(default_model: str) -> None:
    rng = random.Random(0)

    def prompts() -> list[list[int]]:  # fresh ones each run: no prefix-cache hits
        return [
            [rng.randrange(100, 40000) for _ in range(rng.randrange(8, 24))] for _ in range(100)
        ]

    long = [rng.randrange(100, 40000) for _ in range(6000)]
    engine = AsyncEngine(EngineConfig(model=default_model, dtype="float32"))
    try:
        alone = _run_shorts(engine, prompts(), None)
        beside = _run_shorts(engine, prompts(), long)
        print(f"100 short requests: {alone:.1f} s alone, {beside:.1f} s beside a 6,000-token one")
        assert beside <= 3.0 * alone, (alone, beside)
        deadline = time.monotonic() + 600
        while engine.stats().num_running and time.monotonic() < deadline:
            time.sleep(0.5)
        assert engine.stats().num_running == 0
        engine.core.scheduler.check_integrity()
    finally:
        engine.shutdown()
