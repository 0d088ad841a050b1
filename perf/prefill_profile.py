"""Where a prefill step's host time goes, on DeepSeek-V2-Lite's shape (GPU) or a tiny one (CPU).

    PYTHONPATH=. python3 perf/prefill_profile.py [--layers 27] [--lens 512,2048] [--json F]
    .venv/bin/python perf/prefill_profile.py --tiny --layers 2 --lens 32      # CPU, seconds

A lone prompt's time to first token is one prefill step. On the H200 it took about 30 ms for
512 tokens, several times its kernel time: the eager forward is bound by the host. This runs
lone prompts of each length through `LLM.generate(max_tokens=1)` and reports, per step: the
wall time (synchronized), the GPU's kernel time and kernel count (torch.profiler), the host ops
by their own time, and the Python functions by their own time (cProfile), so the costliest
host work can be named. `--decode` adds the eager engine's batch-1 decode step (graphs off).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))

from write_v2lite_checkpoint import write_checkpoint  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n,), generator=g).tolist()


def timed(llm: LLM, ids: list[int], max_tokens: int, device: torch.device) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    llm.generate([ids], params)
    sync(device)
    return time.perf_counter() - t0


def torch_profile(run: Any, reps: int, device: torch.device) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            run()
    events = prof.events()
    gpu = [e for e in events if str(e.device_type).endswith("CUDA")]
    host_self: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if not str(e.device_type).endswith("CUDA"):
            slot = host_self[e.name[:80]]
            slot[0] += 1
            slot[1] += e.self_cpu_time_total
    top = sorted(host_self.items(), key=lambda kv: -kv[1][1])[:20]
    return dict(
        gpu_ms=sum(e.time_range.end - e.time_range.start for e in gpu) / 1e3 / reps,
        kernels=len([e for e in gpu if not e.name.startswith(("Memcpy", "Memset"))]) / reps,
        aten_ops=sum(n for k, (n, _) in host_self.items() if k.startswith("aten::")) / reps,
        top_host_ops=[dict(name=k, calls=n / reps, ms=us / 1e3 / reps) for k, (n, us) in top],
    )


def python_profile(run: Any, reps: int, top: int = 30) -> list[dict[str, Any]]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        run()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, calls, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            dict(
                fn=f"{Path(file).name}:{line}:{fn}",
                calls=calls / reps,
                own_ms=tt * 1e3 / reps,
                cum_ms=ct * 1e3 / reps,
            )
        )
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


def measure(llm: LLM, n: int, max_tokens: int, reps: int, device: torch.device) -> dict[str, Any]:
    vocab = llm.core.runner.model_config.vocab_size
    seed = iter(range(10_000 * n, 10_000 * n + 10_000))
    for _ in range(3):  # warm-up: Triton compiles this length's tiles
        timed(llm, prompt(n, vocab, next(seed)), max_tokens, device)
    walls = [timed(llm, prompt(n, vocab, next(seed)), max_tokens, device) for _ in range(reps)]
    res: dict[str, Any] = dict(tokens=n, max_tokens=max_tokens, wall_ms=[1e3 * w for w in walls])
    res["wall_ms_median"] = 1e3 * statistics.median(walls)

    def run() -> None:
        timed(llm, prompt(n, vocab, next(seed)), max_tokens, device)

    res["torch"] = torch_profile(run, 3, device)
    res["python"] = python_profile(run, 3)
    return res


def report(res: dict[str, Any]) -> str:
    lines = []
    for key, r in res["runs"].items():
        t = r["torch"]
        lines.append(
            f"== {key}: wall {r['wall_ms_median']:.2f} ms (median of {len(r['wall_ms'])}), "
            f"GPU {t['gpu_ms']:.2f} ms in {t['kernels']:.0f} kernels, {t['aten_ops']:.0f} aten ops"
        )
        lines.append("  host ops by own time (ms per step, calls):")
        for o in t["top_host_ops"][:12]:
            lines.append(f"    {o['ms']:7.3f} {o['calls']:7.0f}  {o['name']}")
        lines.append("  python functions by own time (ms per step, calls, cumulative ms):")
        for p in r["python"][:25]:
            lines.append(f"    {p['own_ms']:7.3f} {p['calls']:7.0f} {p['cum_ms']:8.2f}  {p['fn']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="checkpoint dir (reused)")
    ap.add_argument("--layers", type=int, default=None, help="default: 27 (tiny: 2)")
    ap.add_argument("--tiny", action="store_true", help="a small shape that runs on CPU")
    ap.add_argument("--lens", default="512,2048", help="prompt lengths")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode", action="store_true", help="also the eager batch-1 decode step")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    layers = a.layers or (2 if a.tiny else None)
    # the full shape shares bench_engine's and gpu_serve's checkpoint directory
    name = "bench-v2lite" + ("-tiny" if a.tiny else "") + (f"-L{layers}" if layers else "")
    out = a.out or Path("/tmp") / name
    info = write_checkpoint(out, layers, a.tiny)
    res: dict[str, Any] = dict(checkpoint=info, device=str(device), runs={})
    llm = LLM(str(out), device=device.type, max_running_requests=16)
    try:
        for n in [int(x) for x in a.lens.split(",")]:
            res["runs"][f"prefill {n}"] = measure(llm, n, 1, a.reps, device)
    finally:
        llm.shutdown()
        del llm
    if a.decode:
        llm = LLM(str(out), device=device.type, max_running_requests=16, enable_cuda_graph=False)
        try:
            # 33 tokens less 1 token: the difference of the two is 32 eager decode steps.
            r33 = measure(llm, 64, 33, a.reps, device)
            r1 = measure(llm, 64, 1, a.reps, device)
            r33["decode_step_ms"] = (r33["wall_ms_median"] - r1["wall_ms_median"]) / 32
            res["runs"]["eager decode (64 in, 33 out)"] = r33
        finally:
            llm.shutdown()
    text = report(res)
    print(text, flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
