"""Tile sweeps of the small-M GEMM (`engine.kernels.small_gemm`) and of the few-row GEMV
(`engine.kernels.gemv`, nn.Linear-shaped weights, 1-4 rows) against cuBLAS, on a decode step's
dense shapes of DeepSeek-V2-Lite, on a GPU.

    PYTHONPATH=. python3 perf/tune_small_gemm.py [--json out.json] [--quick]

Each measurement is a CUDA graph of launches that cycle through enough copies of the weight
(256 MB or more, over 2x the H200's L2) that every launch streams its weight from HBM, as a
decode step does (the experts between two layers' projections evict them). Reported per shape
and row count: cuBLAS (F.linear / torch.bmm) us per call, the best tiles and their us, the
default tiles' us, the GEMV's best (nn.Linear shapes, up to 4 rows), and each as a share of the
copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.kernels.gemv import MAX_ROWS as GEMV_ROWS
from engine.kernels.gemv import GemvConfig, gemv
from engine.kernels.small_gemm import SmallGemmConfig, default_config, small_matmul

# name: (batch (heads), K, N, weight layout): "nk" = nn.Linear's [N, K], "kn" = [K, N]
SHAPES = {
    "fused_qkv_a 2048->3648": (1, 2048, 3648, "nk"),
    "o_proj 2048->2048": (1, 2048, 2048, "nk"),
    "dense down 10944->2048": (1, 10944, 2048, "nk"),
    "w_kc 16x 128->512": (16, 128, 512, "kn"),
    "w_vc 16x 512->128": (16, 512, 128, "nk"),
}
ROWS = (1, 4, 16)
POOL_BYTES = 256 << 20


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)


def weights(batch: int, k: int, n: int, layout: str) -> list[torch.Tensor]:
    """Copies of a [B, K, N] weight (views of [B, N, K] for "nk"), POOL_BYTES or more in all."""
    one = batch * k * n * 2
    count = max(4, -(-POOL_BYTES // one))
    out = []
    for _ in range(count):
        if layout == "nk":
            w = torch.randn(batch, n, k, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        else:
            w = torch.randn(batch, k, n, device="cuda", dtype=torch.bfloat16)
        out.append(w)
    return out


def time_graph(calls: list[Callable[[], Any]], reps: int = 5) -> float:
    """us per call of a CUDA graph that makes every call once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def cublas_call(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    """F.linear (one head: the weight as nn.Linear holds it) or torch.bmm."""
    if x.shape[0] == 1:
        x2, w2 = x[0], w[0].t()
        return lambda: F.linear(x2, w2)
    return lambda: torch.bmm(x, w, out=y)


def ours_call(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: SmallGemmConfig | None
) -> Callable[[], Any]:
    return lambda: small_matmul(x, w, out=y, config=cfg)


def gemv_call(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig) -> Callable[[], Any]:
    x2, w2 = x[0], w[0].t()  # [M, K], [N, K] (contiguous rows)
    y2 = x2.new_empty(x2.shape[0], w2.shape[0])
    return lambda: gemv(x2, w2, out=y2, config=cfg)


GEMV_CONFIGS = [GemvConfig(n, w) for n in (2, 4, 8, 16) for w in (1, 2, 4, 8)]


def configs(quick: bool) -> list[SmallGemmConfig]:
    if quick:
        return [SmallGemmConfig(16, 256, 4, 4), SmallGemmConfig(32, 128, 4, 4)]
    grid = itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4, 6))
    extra = [SmallGemmConfig(16, 256, 2, 4), SmallGemmConfig(16, 512, 4, 3),
             SmallGemmConfig(32, 256, 8, 4)]  # fmt: skip
    return [SmallGemmConfig(*c) for c in grid] + extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="two tile configs (a smoke run)")
    ap.add_argument("--gemv-only", action="store_true", help="only the GEMV (and cuBLAS)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    cands = configs(args.quick)
    results: list[dict[str, Any]] = []
    jobs = [(name, m) for name in SHAPES for m in ROWS]
    if args.gemv_only:  # the shapes and row counts it takes
        jobs = [(name, m) for name, m in jobs if SHAPES[name][0] == 1 and m <= GEMV_ROWS]
        cands = cands[:1]
    for name, m in tqdm(jobs, desc="shapes"):
        batch, k, n, layout = SHAPES[name]
        ws = weights(batch, k, n, layout)
        x = torch.randn(batch, m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(batch, m, n, device="cuda", dtype=torch.bfloat16)
        ideal_us = batch * k * n * 2 / bw * 1e6
        cublas = time_graph([cublas_call(x, w, y) for w in ws])
        timed = []
        for cfg in cands:
            try:
                us = time_graph([ours_call(x, w, y, cfg) for w in ws])
            except Exception as e:  # a tile that does not fit (shared memory): skip it
                tqdm.write(f"{name} m={m} {cfg}: {type(e).__name__}")
                continue
            timed.append((us, cfg))
        timed.sort(key=lambda t: t[0])
        dflt = default_config(n, k)
        dflt_us = next((us for us, c in timed if c == dflt), None)
        if dflt_us is None:
            dflt_us = time_graph([ours_call(x, w, y, None) for w in ws])
        gemv_timed = []
        if batch == 1 and layout == "nk" and m <= GEMV_ROWS:
            for gcfg in GEMV_CONFIGS[:2] if args.quick else GEMV_CONFIGS:
                try:
                    gemv_timed.append((time_graph([gemv_call(x, w, gcfg) for w in ws]), gcfg))
                except Exception as e:  # registers or shared memory: skip it
                    tqdm.write(f"{name} m={m} {gcfg}: {type(e).__name__}")
            gemv_timed.sort(key=lambda t: t[0])
        best_us, best = timed[0]
        row = dict(shape=name, m=m, ideal_us=ideal_us, cublas_us=cublas, best_us=best_us,
                   best=best._asdict(), default_us=dflt_us, default=dflt._asdict(),
                   top5=[dict(us=us, **c._asdict()) for us, c in timed[:5]],
                   gemv_top5=[dict(us=us, **c._asdict()) for us, c in gemv_timed[:5]])  # fmt: skip
        results.append(row)
        tqdm.write(
            f"{name:24s} m={m:2d} | cuBLAS {cublas:6.2f} us ({ideal_us / cublas:4.0%}) | "
            f"best {best_us:6.2f} ({ideal_us / best_us:4.0%}) {tuple(best)} | "
            f"default {dflt_us:6.2f} ({ideal_us / dflt_us:4.0%}) {tuple(dflt)} | "
            f"default vs cuBLAS {cublas / dflt_us:4.2f}x"
        )
        if gemv_timed:
            g_us, g_cfg = gemv_timed[0]
            tqdm.write(
                f"{'':24s} m={m:2d} | GEMV best {g_us:6.2f} us ({ideal_us / g_us:4.0%}) "
                f"{tuple(g_cfg)} | vs cuBLAS {cublas / g_us:4.2f}x"
            )
        del ws
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bandwidth_Bps=bw, results=results), f, indent=2)


if __name__ == "__main__":
    main()
