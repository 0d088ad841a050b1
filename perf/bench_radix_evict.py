"""Host time of one radix-cache eviction under memory pressure (CPU, no torch).

    .venv/bin/python perf/bench_radix_evict.py [--prompts 1000 10000 30000] [--evict 64]

Caches `--prompts` finished requests (20 shared 200-token system prompts, each request 30
tokens of its own, as a server with many distinct chats holds them), then times `evict` of
`--evict` tokens (a decode step's worth at that batch) over repeated calls, each freeing the
least recently used prompt's leaf: the call a scheduler makes when the pool is full of cached
prefixes.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.mem_cache.allocator import TokenSlotAllocator  # noqa: E402
from engine.mem_cache.radix_cache import RadixCache  # noqa: E402

SYSTEM_PROMPTS, SYSTEM_LEN, OWN_LEN, CALLS = 20, 200, 30, 50


def cached_tree(num_prompts: int, rng: random.Random) -> RadixCache:
    # (room for the cached tokens and one more request's before its duplicates are freed)
    size = (num_prompts + 1) * OWN_LEN + (SYSTEM_PROMPTS + 1) * SYSTEM_LEN
    allocator = TokenSlotAllocator(size)
    tree = RadixCache(allocator)
    systems = [[rng.randrange(50_000) for _ in range(SYSTEM_LEN)] for _ in range(SYSTEM_PROMPTS)]
    for i in range(num_prompts):
        ids = systems[i % SYSTEM_PROMPTS] + [rng.randrange(50_000) for _ in range(OWN_LEN)]
        slots = allocator.alloc(len(ids))
        assert slots is not None
        tree.cache_finished(ids, slots)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[1_000, 10_000, 30_000])
    parser.add_argument("--evict", type=int, default=64)
    args = parser.parse_args()
    print("| cached prompts | tree nodes | evict ms a call (median of 50) |")
    print("| --- | --- | --- |")
    for n in args.prompts:
        tree = cached_tree(n, random.Random(0))
        nodes = len(tree._nodes())
        times = []
        for _ in range(CALLS):
            t0 = time.perf_counter()
            tree.evict(args.evict)
            times.append(time.perf_counter() - t0)
        times.sort()
        print(f"| {n:,} | {nodes:,} | {times[CALLS // 2] * 1e3:.3f} |")


if __name__ == "__main__":
    main()
