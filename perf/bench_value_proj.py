"""MLA decode with the value projection (W_UV) at a few requests: the split merge and the
projection in one kernel (`_merge_project`, the engine's pick up to MERGE_PROJECT_MAX_ROWS
requests and MERGE_PROJECT_MAX_SPLITS splits: `merge_project_wanted`) against the merge
(`merge_splits`) and then the projection, on the engine's layout (page size 1) over bf16 and
FP8 caches, through the Gluon kernels as the engine picks them.

    PYTHONPATH=. python3 perf/bench_value_proj.py [--batches 1 4] [--contexts 1024 4096 16384]
        [--max-seq-len 32768] [--breakdown] [--merge-inside]

Prints us a call for each path and for the engine's pick (CUDA-graph replays,
`bench_kernels.time_graph`) and the largest difference between the two outputs.
`--max-seq-len` sets the context the split count is chosen for, as a CUDA graph captured for
the engine's longest context has it. `--breakdown` adds each path without PDL, the attention
without the projection (stage 1 and `merge_splits`), the projection alone, and the two-kernel
path with its projection launched without PDL, without its L2 prefetch, or by torch.bmm: run
AQ found the two-kernel path slow at few splits (17.1 us at batch 1 ctx 1K against 7.8 for the
attention alone), which these separate (run AR). `--merge-inside` adds the split merge inside
stage 1 (`MLADecodeConfig.merge_inside`) followed by the projection, as the engine would run it
at 5 or more requests, with the projection as the engine launches it, without PDL, and without
its prefetch: run AS found the engine 1% slower with the merge inside at 16 requests while the
attention alone was faster.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_kernels  # noqa: E402

from engine.kernels import launch as kernel_launch  # noqa: E402
from engine.kernels import mla_decode as md  # noqa: E402
from engine.kernels import small_gemm  # noqa: E402

HEADS, V = 16, 128  # DeepSeek-V2-Lite: 16 heads, v_head_dim 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--breakdown", action="store_true", help="PDL off, and each part alone")
    ap.add_argument(
        "--merge-inside", action="store_true", help="also the merge inside stage 1, then W_UV"
    )
    ap.add_argument(
        "--max-seq-len", type=int, default=0,
        help="the split count's context, as a CUDA graph captured for the engine's longest "
        "context has it (default: each point's own context)",
    )  # fmt: skip
    args = ap.parse_args()
    c, r = bench_kernels.C, bench_kernels.R
    scale = (c + r) ** -0.5
    rows, splits = md.MERGE_PROJECT_MAX_ROWS, md.MERGE_PROJECT_MAX_SPLITS
    print(f"GPU: {torch.cuda.get_device_name()}  MERGE_PROJECT_MAX_ROWS={rows}  _SPLITS={splits}")
    head = "| kv | batch | ctx | split count's ctx | merge + projection in one kernel us "
    head += "| merge, then projection us | one kernel vs two | max abs diff | engine's pick us |"
    if args.breakdown:
        head += " one kernel, no PDL | two, no PDL | stage 1 + merge | projection alone |"
        head += " two, projection without PDL | two, projection without its prefetch |"
        head += " two, projection by torch.bmm |"
    if args.merge_inside:
        head += " merge inside, then projection | the same, projection without PDL |"
        head += " the same, projection without its prefetch |"
    print(head)
    print("| --- " * (head.count("|") - 1) + "|")
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(HEADS, V, c, device="cuda", generator=g) / c**0.5).to(torch.bfloat16)
    w = w.transpose(1, 2)  # [H, C, V], the strided view the layer passes
    for batch in args.batches:
        for ctx in args.contexts:
            p = bench_kernels.MLAPoint(batch, ctx)
            q = p.q(HEADS)
            for kv_name in ("bf16", "fp8"):
                fp8 = kv_name == "fp8"
                kv = (p.cache8 if fp8 else p.cache).view(-1, 1, c + r)
                max_len = max(ctx, args.max_seq_len)
                cfg = md.gluon_config(HEADS, batch, max_len, fp8=fp8)

                call = functools.partial(
                    md.mla_decode, q, kv, p.req_to_token, p.req_pool_indices, p.seq_lens, c,
                    scale, k_scale=p.k_scale if fp8 else None, max_seq_len=max_len, config=cfg,
                    value_proj=w,
                )  # fmt: skip

                times, outs = [], []
                for fused in (True, False):
                    with merge_project(fused, batch):
                        times.append(bench_kernels.time_graph(call, args.calls, args.reps))
                        outs.append(call().float())
                diff = (outs[0] - outs[1]).abs().max().item()
                pick = bench_kernels.time_graph(call, args.calls, args.reps)
                line = f"| {kv_name} | {batch} | {ctx} | {max_len} | {times[0] * 1e6:.1f} | "
                line += f"{times[1] * 1e6:.1f} | {times[1] / times[0]:.2f}x | {diff:.1e} | "
                line += f"{pick * 1e6:.1f} |"
                if args.breakdown:
                    line += breakdown(call, args, batch)
                if args.merge_inside:
                    line += inside(call, args, batch)
                print(line, flush=True)


@contextlib.contextmanager
def merge_project(fused: bool, batch: int) -> Iterator[None]:
    """Within it, `mla_decode` merges and projects in one kernel (fused) or in two."""
    rows, splits = md.MERGE_PROJECT_MAX_ROWS, md.MERGE_PROJECT_MAX_SPLITS
    md.MERGE_PROJECT_MAX_ROWS = max(rows, batch) if fused else 0
    md.MERGE_PROJECT_MAX_SPLITS = 64 if fused else splits  # 64: `choose_num_kv_splits`'s most
    try:
        yield
    finally:
        md.MERGE_PROJECT_MAX_ROWS, md.MERGE_PROJECT_MAX_SPLITS = rows, splits


def breakdown(call: functools.partial[torch.Tensor], args: argparse.Namespace, batch: int) -> str:
    """Both paths with PDL off, then the attention without the projection and the
    projection alone (PDL on), us as table cells."""
    cells, pdl = [], kernel_launch.pdl_active()
    kernel_launch.set_pdl(False)
    try:
        for fused in (True, False):
            with merge_project(fused, batch):
                cells.append(bench_kernels.time_graph(call, args.calls, args.reps))
    finally:
        kernel_launch.set_pdl(pdl)
    attend = functools.partial(call, value_proj=None)
    cells.append(bench_kernels.time_graph(attend, args.calls, args.reps))
    out, w = attend(), call.keywords["value_proj"]
    cells.append(bench_kernels.time_graph(lambda: md._project(out, w), args.calls, args.reps))
    with merge_project(False, batch):
        for variant in ("no PDL", "no prefetch", "bmm"):
            two = functools.partial(two_kernels, attend, w, variant)
            cells.append(bench_kernels.time_graph(two, args.calls, args.reps))
    return "".join(f" {t * 1e6:.1f} |" for t in cells)


def inside(call: functools.partial[torch.Tensor], args: argparse.Namespace, batch: int) -> str:
    """Stage 1 with the merge inside it (where it serves), then the projection: as the engine
    launches it, without PDL, without its prefetch; us as table cells."""
    cfg = call.keywords["config"]._replace(merge_inside=True)
    attend = functools.partial(call, value_proj=None, config=cfg)
    w, cells = call.keywords["value_proj"], []
    with merge_project(False, batch):
        for variant in ("PDL", "no PDL", "no prefetch"):
            two = functools.partial(two_kernels, attend, w, variant)
            cells.append(bench_kernels.time_graph(two, args.calls, args.reps))
    return "".join(f" {t * 1e6:.1f} |" for t in cells)


def two_kernels(
    attend: functools.partial[torch.Tensor], w: torch.Tensor, variant: str
) -> torch.Tensor:
    """Stage 1 and the merge with PDL, then the projection: launched with PDL as the engine
    does ("PDL"), without PDL, with PDL but without the weight's L2 prefetch before its wait,
    or by torch.bmm."""
    out = attend()
    if variant == "bmm":
        return torch.bmm(out.transpose(0, 1), w).transpose(0, 1)
    pdl, span = kernel_launch.pdl_active(), small_gemm.contiguous_span
    try:
        if variant == "no PDL":
            kernel_launch.set_pdl(False)
        elif variant == "no prefetch":
            small_gemm.contiguous_span = lambda t: 0
        return md._project(out, w)
    finally:
        kernel_launch.set_pdl(pdl)
        small_gemm.contiguous_span = span


if __name__ == "__main__":
    main()
