"""What `page_size` costs the prefix cache and the KV memory, with the radix cache on.

Issue 16 asks whether the engine's default layout could be pages of 64 slots (the MLA decode
kernel reads one slot id per page-sized tile then) without hurting prefix sharing or memory.
This drives the real scheduler and radix cache (no model: tokens come from a deterministic fake,
as in tests/test_scheduler.py, so it runs in seconds on a CPU) through two workloads:

- `chat`: conversations that share one system prompt, each turn's prompt being the whole
  history (system prompt, earlier turns and answers) plus a new user message;
- `shared_prompt`: single-turn requests behind one long shared instruction;
- `n_sequences`: requests of n = 4 sequences (`SamplingParams.n`: the engine runs each as a
  request of its own) over prompts of their own.

and reports, per page size: the share of prompt tokens served from the cache, the prefill
tokens actually computed, and the slots held by running requests against the tokens they hold
(a request owns whole pages, so its last page is partly empty), at the peak and on average.

    .venv/bin/python perf/bench_page_size.py [--pages 1,16,64] [--json out.json]
        [--no-in-batch-check]   (as the scheduler ran before its in-batch prefix check)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler.request import Req  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402


@dataclass
class Result:
    workload: str
    page_size: int
    prompt_tokens: int
    cache_hit_tokens: int
    computed_prefill_tokens: int
    hit_share: float
    peak_slots_held: int
    peak_tokens_held: int
    mean_slot_waste: float  # (slots held - tokens held) / tokens held, over decode steps


def _fake_token(req: Req) -> int:
    return (sum(req.all_ids[-8:]) * 31 + len(req.all_ids)) % 30000 + 100


class Driver:
    """Runs the scheduler; new requests come from `next_request(finished_req)`."""

    def __init__(self, page: int, pool: int, max_running: int) -> None:
        config = EngineConfig(page_size=page, max_running_requests=max_running)
        self.sched = Scheduler(config, pool, pool, max_running)
        self.peak_slots = self.peak_tokens = 0
        self.waste: list[float] = []

    def run(self, first: list[Req], follow_up: Callable[[Req], Req | None]) -> None:
        sched = self.sched
        for r in first:
            sched.add_request(r)
        while sched.has_work():
            out = sched.schedule()
            assert out is not None
            next_ids = {row: _fake_token(out.reqs[row]) for row in out.sample_rows}
            for req in sched.process_batch(out, next_ids):
                if len(req.output_ids) >= req.params.max_tokens:
                    sched.finish(req, "length")
                    nxt = follow_up(req)
                    if nxt is not None:
                        sched.add_request(nxt)
            slots = sched.in_use_slots()
            tokens = sum(len(r.kv_slots) - sched._tree_owned(r) for r in sched.active())
            self.peak_slots = max(self.peak_slots, slots)
            self.peak_tokens = max(self.peak_tokens, tokens)
            if tokens:
                self.waste.append((slots - tokens) / tokens)


def chat(page: int, seed: int = 0) -> Result:
    rng = random.Random(seed)
    system = [rng.randrange(100, 30000) for _ in range(400)]
    conversations, turns = 64, 6
    history: dict[str, list[int]] = {}
    turn_of: dict[str, int] = {}

    def turn(conv: int, prompt: list[int]) -> Req:
        rid = f"c{conv}-t{turn_of.get(str(conv), 0)}"
        params = SamplingParams(max_tokens=rng.randrange(40, 200), ignore_eos=True)
        return Req(rid=rid, prompt_ids=prompt, params=params, arrival=0)

    def user() -> list[int]:
        return [rng.randrange(100, 30000) for _ in range(rng.randrange(10, 80))]

    first = []
    for c in range(conversations):
        history[str(c)] = system + user()
        turn_of[str(c)] = 0
        first.append(turn(c, history[str(c)]))

    def follow_up(req: Req) -> Req | None:
        conv = req.rid.split("-")[0][1:]
        turn_of[conv] += 1
        if turn_of[conv] >= turns:
            return None
        history[conv] = req.all_ids + user()
        return turn(int(conv), history[conv])

    driver = Driver(page, pool=1 << 20, max_running=32)
    driver.run(first, follow_up)
    return _result("chat", page, driver)


def shared_prompt(page: int, seed: int = 1) -> Result:
    rng = random.Random(seed)
    instruction = [rng.randrange(100, 30000) for _ in range(1500)]
    reqs = [
        Req(
            rid=f"r{i}",
            prompt_ids=instruction
            + [rng.randrange(100, 30000) for _ in range(rng.randrange(5, 60))],
            params=SamplingParams(max_tokens=rng.randrange(20, 120), ignore_eos=True),
            arrival=0,
        )
        for i in range(256)
    ]
    driver = Driver(page, pool=1 << 20, max_running=64)
    driver.run(reqs, lambda req: None)
    return _result("shared_prompt", page, driver)


def n_sequences(page: int, seed: int = 2) -> Result:
    rng = random.Random(seed)
    reqs = []
    for i in range(64):
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randrange(800, 1200))]
        params = SamplingParams(max_tokens=rng.randrange(20, 120), ignore_eos=True)
        reqs += [
            Req(rid=f"r{i}/{k}", prompt_ids=prompt, params=params, arrival=0) for k in range(4)
        ]
    driver = Driver(page, pool=1 << 20, max_running=64)
    driver.run(reqs, lambda req: None)
    return _result("n_sequences", page, driver)


def _result(workload: str, page: int, driver: Driver) -> Result:
    c = driver.sched.counters
    driver.sched.check_integrity()
    return Result(
        workload=workload,
        page_size=page,
        prompt_tokens=c.prompt_tokens,
        cache_hit_tokens=c.cache_hit_tokens,
        computed_prefill_tokens=c.computed_prefill_tokens,
        hit_share=c.cache_hit_tokens / c.prompt_tokens,
        peak_slots_held=driver.peak_slots,
        peak_tokens_held=driver.peak_tokens,
        mean_slot_waste=sum(driver.waste) / max(len(driver.waste), 1),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--pages", default="1,16,64")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-in-batch-check", action="store_true")
    args = ap.parse_args(argv)
    if args.no_in_batch_check:  # no request waits for one of its step to compute its head
        Scheduler._computed_in_batch = lambda self, req, cached, entries: False  # type: ignore[method-assign]
    results = [
        fn(int(p))
        for fn in (chat, shared_prompt, n_sequences)
        for p in args.pages.split(",")
        if p.strip()
    ]
    print(
        "workload       page | prompt tok | cache hits      | computed | peak held (tokens) | waste"
    )
    for r in results:
        print(
            f"{r.workload:14s} {r.page_size:4d} | {r.prompt_tokens:10,d} | "
            f"{r.cache_hit_tokens:9,d} {r.hit_share:5.1%} | {r.computed_prefill_tokens:8,d} | "
            f"{r.peak_slots_held:8,d} ({r.peak_tokens_held:,d}) | {r.mean_slot_waste:5.1%}"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
