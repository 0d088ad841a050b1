"""Where a prefill step's GPU time goes, per KV-cache dtype, kernel by kernel.

Each KV dtype runs in a process of its own (as bench_engine's --isolate): an engine on the
checkpoint, a few warm-up prefills, then `--reps` timed batches of `--n` fresh prompts of
`--prompt-len` tokens that each draw one token (one prefill step), and one such batch under
torch.profiler. The table lists the kernels by name with their time per step for each dtype,
largest difference first, so a dtype's extra time shows where it is spent.

    python3 perf/profile_prefill.py --model /tmp/bench-v2lite --kv bf16,fp8 [--n 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

KV_DTYPES = {"bf16": "auto", "fp8": "fp8_e4m3"}


def run_one(args: argparse.Namespace, kv: str) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    llm = LLM(str(args.model), kv_cache_dtype=KV_DTYPES[kv], device=args.device)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def batch() -> float:
        prompts = torch.randint(10, vocab, (args.n, args.prompt_len), generator=g).tolist()
        sync()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        sync()
        return time.perf_counter() - t0

    for _ in range(3):
        batch()
    host = None
    if args.cprofile:  # the host's functions over the timed batches, by their own time
        import cProfile
        import io
        import pstats

        cprof = cProfile.Profile()
        cprof.enable()
    walls = [batch() for _ in range(args.reps)]
    if args.cprofile:
        cprof.disable()
        buf = io.StringIO()
        pstats.Stats(cprof, stream=buf).sort_stats("tottime").print_stats(args.top)
        host = buf.getvalue()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        batch()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if str(e.device_type).endswith("CUDA"):
            slot = kernels[e.name[:80]]
            slot[0] += 1
            slot[1] += e.time_range.end - e.time_range.start
    llm.shutdown()
    return dict(kv=kv, wall_ms=[1e3 * w for w in walls], kernels=dict(kernels), host=host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--n", type=int, default=4, help="prompts per step")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cprofile", action="store_true", help="also profile the host (cProfile)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child: this KV dtype, JSON to --out
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        assert args.out is not None
        args.out.write_text(json.dumps(run_one(args, args.one)))
        return
    kvs = args.kv.split(",")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kv in kvs:
            out = Path(tmp) / f"{kv}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", kv, "--out", str(out)]
            subprocess.run(cmd, check=True, env=os.environ.copy())
            results[kv] = json.loads(out.read_text())
    for kv, r in results.items():
        walls = r["wall_ms"]
        total = sum(t for _, t in r["kernels"].values()) / 1e3
        print(
            f"{kv}: {args.n} x {args.prompt_len} tokens, one step: wall median "
            f"{statistics.median(walls):.2f} ms (min {min(walls):.2f}); profiled kernels "
            f"{total:.2f} ms in {sum(n for n, _ in r['kernels'].values())} launches; "
            f"every batch (ms): {' '.join(f'{w:.1f}' for w in walls)}"
        )
        if r["host"]:
            print(r["host"])
    names = sorted({k for r in results.values() for k in r["kernels"]})
    base = kvs[0]

    def us(kv: str, name: str) -> float:
        return results[kv]["kernels"].get(name, [0, 0.0])[1]

    rows = sorted(names, key=lambda k: -max(abs(us(kv, k) - us(base, k)) for kv in kvs))
    print(f"{'kernel':<80} " + " ".join(f"{kv + ' n/us':>16}" for kv in kvs))
    for name in rows[: args.top]:
        cells = [results[kv]["kernels"].get(name, [0, 0.0]) for kv in kvs]
        print(f"{name:<80} " + " ".join(f"{int(n):>5} {t:>10.1f}" for n, t in cells))


if __name__ == "__main__":
    main()
