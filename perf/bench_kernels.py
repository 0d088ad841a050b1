"""Kernel benchmarks on one GPU: MLA decode against FlashMLA, fused MoE against a per-expert loop,
the FP8 batched matmul of MLA's absorbed weights against bf16 `torch.bmm`.
The MoE section ends with a decode table at 1-4 tokens with V2-Lite's 2 shared-expert slots.

Run on the device (H200):  python3 perf/bench_kernels.py [--tune] [--no-moe] [--out DIR]
                           python3 perf/bench_kernels.py --fp8-bmm-only [--tune-fp8-bmm]
FlashMLA comes from the `sgl-flash-mla` wheel (carried; the MLA table skips it when missing).

Every time is a CUDA-graph replay of `--calls` back-to-back calls (launch gaps hidden), median
over `--reps` replays, divided by the call count. Bandwidth counts the bytes each call must
move at least: KV rows read + q read + o written for attention; for MoE the expert weights
touched + activations. The device-to-device copy bandwidth is measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.kernels import mla_decode as md  # noqa: E402
from engine.kernels.mla_decode import (  # noqa: E402
    MLADecodeConfig,
    default_config,
    gluon_config,
    mla_decode,
    mla_decode_paged,
)
from engine.kernels.mla_decode_gluon import fits as gluon_fits  # noqa: E402
from engine.kernels.utils import choose_num_kv_splits  # noqa: E402

C, R, PAGE = 512, 64, 64
HEADS = (16, 128)
BATCHES = (1, 16, 64, 128)
CONTEXTS = (1024, 4096, 16384)


def time_graph(fn: Callable[[], Any], calls: int, reps: int) -> float:
    """Median seconds per call of `fn`, from CUDA-graph replays of `calls` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, GB/s counting bytes read + written (1 GiB buffers).

    The best of a copy kernel (`torch.mul(src, 1, out=dst)`) and `copy_` (which a graph may run
    on the copy engines, slower).
    """
    n = 1 << 29
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t_kernel = time_graph(lambda: torch.mul(src, 1, out=dst), calls=10, reps=10)
    t_copy = time_graph(lambda: dst.copy_(src), calls=10, reps=10)
    return 2 * n * 2 / min(t_kernel, t_copy) / 1e9


class MLAPoint:
    """Shared inputs for one (batch, context): a paged bf16 cache, its fp8 copy and the tables.

    The page-size-1 `req_to_token` view points at the same rows as the block table, so every
    variant reads the same memory.
    """

    def __init__(self, batch: int, ctx: int) -> None:
        self.batch, self.ctx = batch, ctx
        pages_per_req = math.ceil(ctx / PAGE)
        num_pages = batch * pages_per_req
        g = torch.Generator(device="cuda").manual_seed(batch * 100003 + ctx)
        self.cache = torch.randn(
            num_pages, PAGE, 1, C + R, device="cuda", dtype=torch.bfloat16, generator=g
        )
        self.k_scale = (self.cache.abs().amax().float() / 448.0).reshape(1)
        self.cache8 = (self.cache.float() / self.k_scale).to(torch.float8_e4m3fn)
        perm = torch.randperm(num_pages, device="cuda", generator=g)
        self.block_table = perm.view(batch, pages_per_req).int()
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        pos = torch.arange(ctx, device="cuda")
        self.req_to_token = (
            self.block_table[:, pos // PAGE].long() * PAGE + pos % PAGE
        ).int()  # [batch, ctx]
        self.req_pool_indices = torch.arange(batch, device="cuda")

    def q(self, heads: int) -> torch.Tensor:
        g = torch.Generator(device="cuda").manual_seed(heads)
        return torch.randn(
            self.batch, heads, C + R, device="cuda", dtype=torch.bfloat16, generator=g
        )

    def bytes(self, heads: int, kv_elem: int) -> int:
        return self.batch * (self.ctx * (C + R) * kv_elem + heads * ((C + R) + C) * 2)


def flashmla_fns(p: MLAPoint, q: torch.Tensor, scale: float) -> dict[str, Callable[[], Any]]:
    try:
        from flash_mla import flash_mla_with_kvcache, get_mla_decoding_metadata
        from flash_mla.flash_mla_interface import FlashMLASchedMeta
    except ImportError:
        return {}
    q4 = q.unsqueeze(1)
    meta = FlashMLASchedMeta()

    def bf16() -> Any:
        return flash_mla_with_kvcache(
            q4, p.cache, p.block_table, p.seq_lens, C, meta,
            softmax_scale=scale, causal=True, use_legacy=True,
        )  # fmt: skip

    q8 = q4.to(torch.float8_e4m3fn)
    one = torch.ones(1, dtype=torch.float32, device="cuda")
    meta8 = FlashMLASchedMeta()
    tsm, splits = get_mla_decoding_metadata(
        p.seq_lens, q.shape[1], 1, is_fp8_kvcache=True, use_legacy=True
    )
    meta8.tile_scheduler_metadata, meta8.num_splits = tsm, splits

    def fp8() -> Any:
        return flash_mla_with_kvcache(
            q8, p.cache8, p.block_table, p.seq_lens, C, meta8, softmax_scale=scale,
            causal=True, is_fp8_kvcache=True, use_legacy=True, descale_q=one,
            descale_k=p.k_scale,
        )  # fmt: skip

    return {"fm_bf16": bf16, "fm_fp8": fp8}


def ours_fns(
    p: MLAPoint,
    q: torch.Tensor,
    scale: float,
    cfg: MLADecodeConfig | None = None,
    splits: int | None = None,
) -> dict[str, Callable[[], Any]]:
    heads = q.shape[1]
    kv1 = p.cache.view(-1, 1, C + R)

    def split_count(fp8: bool, page: int) -> int:
        if splits is not None:
            return splits
        c = cfg or default_config(heads, fp8, page)
        return choose_num_kv_splits(
            p.batch, heads, p.ctx, c.block_h, c.block_n, waves=c.waves,
            min_tokens_per_split=c.min_split_tokens,
        )  # fmt: skip

    s_b, s_1, s_8 = split_count(False, PAGE), split_count(False, 1), split_count(True, PAGE)
    kv8 = p.cache8.view(-1, 1, C + R)

    def engine_pool(kv: torch.Tensor, splits: int, k_scale: Any = None, page: int = 1) -> Any:
        """The engine's pool: one slot id per position in `req_to_token` (page size 1), or
        one per tile with `page` (its paged pool)."""
        return lambda: mla_decode(
            q, kv, p.req_to_token, p.req_pool_indices, p.seq_lens, C, scale, k_scale=k_scale,
            num_kv_splits=splits, config=cfg, page_size=page,
        )  # fmt: skip

    def paged(cache: torch.Tensor, splits: int, k_scale: Any = None) -> Any:
        """FlashMLA's layout: a block table over [pages, PAGE, 1, C + R]."""
        return lambda: mla_decode_paged(
            q, cache, p.block_table, p.seq_lens, C, scale, k_scale=k_scale,
            num_kv_splits=splits, config=cfg,
        )  # fmt: skip

    fns = {
        "ours_bf16": paged(p.cache, s_b),
        "ours_bf16_p1": engine_pool(kv1, s_1),
        "ours_bf16_p64": engine_pool(kv1, s_b, page=PAGE),
        "ours_fp8": paged(p.cache8, s_8, p.k_scale),
        "ours_fp8_p1": engine_pool(kv8, split_count(True, 1), p.k_scale),
    }
    if cfg is None and gluon_fits(q.device, C, R, PAGE):
        # The Gluon kernel as the engine picks it (`EngineConfig.mla_decode_kernel="gluon"`):
        # its config for this call's size, its own split count.
        g = gluon_config(heads, p.batch, p.ctx)
        fns["gluon_fp8_p1"] = lambda: mla_decode(
            q, kv8, p.req_to_token, p.req_pool_indices, p.seq_lens, C, scale,
            k_scale=p.k_scale, max_seq_len=p.ctx, config=g,
        )  # fmt: skip
        fns["gluon_fp8"] = lambda: mla_decode_paged(
            q, p.cache8, p.block_table, p.seq_lens, C, scale, k_scale=p.k_scale,
            max_seq_len=p.ctx, config=g,
        )  # fmt: skip
    if cfg is None and gluon_fits(q.device, C, R, PAGE):
        # The bf16 Gluon kernel as the engine picks it: 64 heads a program at 64+ heads, else
        # the 16-head kernel over the bf16 ring.
        w = gluon_config(heads, p.batch, p.ctx, fp8=False)
        fns["gluon_bf16_p1"] = lambda: mla_decode(
            q, kv1, p.req_to_token, p.req_pool_indices, p.seq_lens, C, scale,
            max_seq_len=p.ctx, config=w,
        )  # fmt: skip
        fns["gluon_bf16"] = lambda: mla_decode_paged(
            q, p.cache, p.block_table, p.seq_lens, C, scale, max_seq_len=p.ctx, config=w
        )
    return fns


def _out(x: Any) -> torch.Tensor:
    """Ours return o [B, H, C]; FlashMLA returns (o [B, 1, H, C], lse)."""
    return x[0].squeeze(1) if isinstance(x, tuple) else x


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_mla(args: argparse.Namespace, copy_gbs: float, log: list[dict[str, Any]]) -> str:
    scale = (C + R) ** -0.5
    rows = []
    header = (
        "| heads | batch | ctx | FlashMLA bf16 us | ours bf16 us (GB/s) | ratio | "
        "ours bf16 page-1 us | ratio | ours bf16 engine page-64 us | ratio | "
        "FlashMLA fp8 us | ours fp8 us (GB/s) | "
        "vs FlashMLA bf16 | vs FlashMLA fp8 | ours fp8 page-1 us | vs FlashMLA fp8 | "
        "bf16 % copy | fp8 % copy | Gluon fp8 page-1 us | vs FlashMLA fp8 | vs FlashMLA bf16 | "
        "Gluon fp8 paged us | vs FlashMLA fp8 | Gluon bf16 page-1 us | vs FlashMLA bf16 | "
        "Gluon bf16 paged us | vs FlashMLA bf16 |\n"
        "|" + " --- |" * 27
    )
    for batch in args.batches:
        for ctx in args.contexts:
            p = MLAPoint(batch, ctx)
            for heads in args.heads:
                q = p.q(heads)
                fns = {**flashmla_fns(p, q, scale), **ours_fns(p, q, scale)}
                t = {k: time_graph(f, args.calls, args.reps) for k, f in fns.items()}
                check = {}
                if "fm_bf16" in fns:
                    ref = _out(fns["fm_bf16"]())
                    for k in ("ours_bf16", "ours_bf16_p1", "ours_bf16_p64", "ours_fp8",
                              "ours_fp8_p1", "fm_fp8", "gluon_fp8_p1", "gluon_fp8",
                              "gluon_bf16_p1", "gluon_bf16"):  # fmt: skip
                        if k in fns:
                            check[k] = rel_err(_out(fns[k]()), ref)
                b16, b8 = p.bytes(heads, 2), p.bytes(heads, 1)
                rec = {"heads": heads, "batch": batch, "ctx": ctx, "t": t, "err": check}
                log.append(rec)
                fm, fm8 = t.get("fm_bf16", float("nan")), t.get("fm_fp8", float("nan"))
                ob, o1, o8 = t["ours_bf16"], t["ours_bf16_p1"], t["ours_fp8"]
                o64, o81 = t["ours_bf16_p64"], t["ours_fp8_p1"]
                line = (
                    f"| {heads} | {batch} | {ctx} | {fm * 1e6:.1f} | "
                    f"{ob * 1e6:.1f} ({b16 / ob / 1e9:.0f}) | {fm / ob:.2f}x | "
                    f"{o1 * 1e6:.1f} | {fm / o1:.2f}x | {o64 * 1e6:.1f} | {fm / o64:.2f}x | "
                    f"{fm8 * 1e6:.1f} | "
                    f"{o8 * 1e6:.1f} ({b8 / o8 / 1e9:.0f}) | {fm / o8:.2f}x | {fm8 / o8:.2f}x | "
                    f"{o81 * 1e6:.1f} | {fm8 / o81:.2f}x | "
                    f"{100 * b16 / ob / 1e9 / copy_gbs:.0f}% | "
                    f"{100 * b8 / o8 / 1e9 / copy_gbs:.0f}% |"
                )
                nan = float("nan")
                g1, gp = t.get("gluon_fp8_p1", nan), t.get("gluon_fp8", nan)
                line += (
                    f" {g1 * 1e6:.1f} | {fm8 / g1:.2f}x | {fm / g1:.2f}x | "
                    f"{gp * 1e6:.1f} | {fm8 / gp:.2f}x |"
                )
                w1, wp = t.get("gluon_bf16_p1", nan), t.get("gluon_bf16", nan)
                line += f" {w1 * 1e6:.1f} | {fm / w1:.2f}x | {wp * 1e6:.1f} | {fm / wp:.2f}x |"
                rows.append(line)
                errs = " ".join(f"{k}={v:.1e}" for k, v in check.items())
                print(line, f"  err vs FlashMLA bf16: {errs}", flush=True)
            del p
            torch.cuda.empty_cache()
    return header + "\n" + "\n".join(rows)


M = MLADecodeConfig
# The FP8 default's QK: e4m3 dots, q as two e4m3 terms through one dot.
PAIRS = {"fp8_dots": True, "q_residual": True, "q_pairs": True}
# The warp-specialized Gluon kernel (sm_90): num_stages e4m3 tiles and `gluon` fp16 V tiles in
# flight, q as two e4m3 terms or one. Run AJ also timed 3 e4m3 tiles with one V tile (1.17x
# slower: the converter then waits on PV) and 2 loader warps (1.02-1.04x slower).
# v_rows splits a tile's fp16 V into slots of that many tokens, so that the e4m3 ring can be
# deeper in the same shared memory (perf/gluon_census.py: all of these fit).
GLUON = [
    MLADecodeConfig(16, 64, 4, 2, 1.0, 128, q_residual=True, gluon=2),
    MLADecodeConfig(16, 64, 4, 2, 2.0, 128, q_residual=True, gluon=2),
    MLADecodeConfig(16, 64, 4, 2, 1.0, 128, gluon=2),
    MLADecodeConfig(16, 64, 4, 3, 1.0, 128, q_residual=True, gluon=3, v_rows=32),
    MLADecodeConfig(16, 64, 4, 3, 1.0, 128, q_residual=True, gluon=6, v_rows=16),
    MLADecodeConfig(16, 64, 4, 4, 1.0, 128, q_residual=True, gluon=3, v_rows=16),
    MLADecodeConfig(16, 64, 4, 4, 1.0, 128, gluon=4, v_rows=16),
    MLADecodeConfig(16, 64, 4, 4, 1.0, 128, gluon=2, v_rows=32),
    # PV as an e4m3 wgmma over a transposed e4m3 V (2 e4m3 tiles, 2 V^T slots), q as two
    # terms or one.
    MLADecodeConfig(16, 64, 4, 2, 1.0, 128, q_residual=True, gluon=2, pv_e4m3=True),
    MLADecodeConfig(16, 64, 4, 2, 1.0, 128, gluon=2, pv_e4m3=True),
    # PV with V^T from the attention group's registers (no converter, no V ring): 3-5 e4m3
    # tiles, q as two terms or one.
    MLADecodeConfig(16, 64, 4, 3, 1.0, 128, q_residual=True, gluon=1, pv_regs=True),
    MLADecodeConfig(16, 64, 4, 4, 1.0, 128, q_residual=True, gluon=1, pv_regs=True),
    MLADecodeConfig(16, 64, 4, 5, 1.0, 128, q_residual=True, gluon=1, pv_regs=True),
    MLADecodeConfig(16, 64, 4, 4, 1.0, 128, gluon=1, pv_regs=True),
]
# The Gluon kernel at 128 heads: 16 heads a program (what the engine takes), and 32 (each tile
# read by half as many programs; V in 32-token slots so that it fits).
GLUON_128 = [
    # 64 heads a program (`mla_decode_gluon_wide`): q in e4m3 as two terms or one, 2 or 3 tiles.
    MLADecodeConfig(64, 64, 4, 2, 1.0, 128, q_residual=True, gluon=1, gluon_heads=64),
    MLADecodeConfig(64, 64, 4, 2, 1.0, 128, gluon=1, gluon_heads=64),
    MLADecodeConfig(64, 64, 4, 3, 1.0, 128, gluon=1, gluon_heads=64),
    MLADecodeConfig(16, 64, 4, 2, 1.0, 128, q_residual=True, gluon=2),
    MLADecodeConfig(32, 64, 4, 3, 1.0, 128, q_residual=True, gluon=2, v_rows=32, gluon_heads=32),
    MLADecodeConfig(32, 64, 4, 2, 1.0, 128, q_residual=True, gluon=2, v_rows=32, gluon_heads=32),
]
# The Gluon kernel of 64 heads a program over a bf16 pool (V split over two warp groups).
GLUON_WIDE = MLADecodeConfig(64, 64, 4, 2, 1.0, 128, gluon=1, gluon_heads=64)
# Fields: block_h, block_n, num_warps, num_stages (then waves, min_split_tokens, slots_ahead,
# halves, fp8_dots, q_residual, q_pairs).
TUNE = {
    # The engine's layout (page size 1). Run AE (perf/RESULTS.md) swept slot ids ahead or with
    # their tile at 64-, 32- and 16-token tiles and 2-4 stages: ids ahead with 32-token tiles
    # won for bf16 at batch 16 and above, the 64-token tile for FP8; ids with their tile never
    # won. Run AF added the latent as two dots (halves, now the default: faster at every point)
    # and a register prefetch of the next tile (one stage; 1.3-5.8x slower, removed). Run AH
    # timed the latent as 4 slices through 3-D dots (1.3-3.4x slower, removed) and QK as an e4m3
    # dot (fp8_dots; with q as two e4m3 terms, q_residual). Run AI timed the two terms through
    # one dot (q_pairs), the 16-head FP8 default since, at page size 1 and paged, and 8 warps
    # with the paired q (64-token tiles 1.04-1.57x slower; 128-token tiles 7-10% faster at
    # batch 1, 1.04-1.20x slower at batch >= 16: dropped).
    (16, "ours_bf16_p1"): [
        M(16, 32, 4, 3, 2.0, 128, halves=True),
        M(16, 64, 4, 3, 2.0, 128, halves=True),
        # Run AK also swept 2 and 4 stages, 16-token tiles and 8 warps: only 8 warps on
        # 64-token tiles won a point (batch 128 ctx 1K, 1.05x), the default everywhere else.
        M(16, 64, 8, 3, 2.0, 128, halves=True),
        # The 16-head Gluon kernel over the bf16 ring (2 slots of 64 tokens; the engine's pick
        # below 64 heads): its split counts around one wave, and two.
        M(16, 64, 4, 2, 1.0, 128, gluon=1, v_rows=64),
        M(16, 64, 4, 2, 2.0, 128, gluon=1, v_rows=64),
    ],
    (16, "ours_fp8_p1"): [
        M(16, 64, 4, 2, 2.0, 128, halves=True, fp8_dots=True),
        M(16, 64, 4, 2, 2.0, 128, halves=True, fp8_dots=True, q_residual=True),
        M(16, 64, 4, 2, 2.0, 128, halves=True, **PAIRS),
        M(16, 128, 8, 2, 1.0, 128, fp8_dots=True),
        *GLUON,
    ],
    (16, "ours_bf16"): [
        M(16, 64, 4, 3),
        M(16, 64, 4, 2),
        M(16, 32, 4, 4),
        M(16, 32, 4, 3, slots_ahead=1),  # page ids ahead: double-buffered, 91 KB
        M(16, 64, 4, 3, halves=True),
        M(16, 32, 4, 3, slots_ahead=1, halves=True),
    ],
    (16, "ours_fp8"): [
        M(16, 64, 4, 3, 1.0, 128, fp8_dots=True),
        M(16, 64, 4, 3, 1.0, 128, fp8_dots=True, q_residual=True),
        M(16, 64, 4, 2, 2.0, 128, halves=True, fp8_dots=True),
        M(16, 64, 4, 2, 2.0, 128, halves=True, **PAIRS),
        *GLUON,
    ],
    (128, "ours_bf16"): [
        M(64, 64, 8, 2),
        M(64, 64, 8, 1),
        M(64, 64, 8, 2, halves=True),
        M(64, 32, 8, 2, halves=True),
        GLUON_WIDE,
    ],
    (128, "ours_bf16_p1"): [M(64, 64, 8, 2), GLUON_WIDE],
    (128, "ours_fp8"): [
        M(64, 64, 8, 2),
        M(64, 64, 8, 2, fp8_dots=True),
        M(64, 64, 8, 1, fp8_dots=True),
        M(64, 64, 8, 1, **PAIRS),
        *GLUON_128,
    ],
    (128, "ours_fp8_p1"): [M(64, 64, 8, 2), *GLUON_128],
}


def _cfg_key(cfg: MLADecodeConfig) -> tuple[int | None, ...]:
    flags = (cfg.halves, cfg.fp8_dots, cfg.q_residual, cfg.q_pairs, cfg.gluon, cfg.v_rows)
    flags += (cfg.gluon_heads, cfg.pv_e4m3, cfg.pv_regs)
    return (*(int(v) for v in cfg[:5]), cfg.slots_ahead, *(int(f) for f in flags))


def split_candidates(batch: int, heads: int, ctx: int, cfg: MLADecodeConfig) -> list[int]:
    """Split counts around the default pick, plus one split (no merge)."""
    base = choose_num_kv_splits(
        batch, heads, ctx, cfg.block_h, cfg.block_n, waves=cfg.waves,
        min_tokens_per_split=cfg.min_split_tokens,
    )  # fmt: skip
    most = max(1, ctx // 128)
    cands = {1, max(1, base // 2), base, base * 2, max(1, base * 3 // 2)}
    return sorted(c for c in cands if c <= most)


def tune_mla(args: argparse.Namespace, log: list[dict[str, Any]]) -> None:
    """Sweep tile configs and split counts (paged bf16 and fp8); print the best per point."""
    scale = (C + R) ** -0.5
    for heads, ctxs in ((16, tuple(args.contexts)), (128, (4096,))):
        if heads not in args.heads:
            continue
        for batch in args.batches:
            for ctx in ctxs:
                p = MLAPoint(batch, ctx)
                q = p.q(heads)
                fms = flashmla_fns(p, q, scale)
                fm = {k: time_graph(f, args.calls, 3) for k, f in fms.items()}
                ref_out = _out(fms["fm_bf16"]()) if fms else None
                for kind in args.kinds:
                    results = []
                    errs: dict[tuple[int, ...], float] = {}
                    if (heads, kind) not in TUNE:
                        print(f"  no tile configs for {kind} at {heads} heads", flush=True)
                        continue
                    for cfg in TUNE[(heads, kind)]:
                        if args.gluon_only and not cfg.gluon:
                            continue
                        try:
                            out = ours_fns(p, q, scale, cfg, 2)[kind]()
                        except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
                            print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                            continue
                        if ref_out is not None:
                            errs[_cfg_key(cfg)] = rel_err(out, ref_out)
                        for splits in split_candidates(batch, heads, ctx, cfg):
                            fn = ours_fns(p, q, scale, cfg, splits)[kind]
                            try:
                                t = time_graph(fn, args.calls, 3)
                            except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
                                print(f"  skip {cfg} s={splits}: {type(e).__name__}", flush=True)
                                break
                            results.append((t, cfg, splits))
                            log.append(
                                {
                                    "tune": kind,
                                    "heads": heads,
                                    "batch": batch,
                                    "ctx": ctx,
                                    "cfg": list(cfg),
                                    "splits": splits,
                                    "t": t,
                                    "err": errs.get(_cfg_key(cfg)),
                                }
                            )
                    results.sort(key=lambda x: x[0])
                    ref = fm.get("fm_bf16", float("nan"))
                    top = ", ".join(
                        f"{t * 1e6:.1f}us {_cfg_key(c)} s={s} "
                        f"err={errs.get(_cfg_key(c), float('nan')):.1e}"
                        for t, c, s in results[:4]
                    )
                    print(f"TUNE h={heads} b={batch} ctx={ctx} {kind}: fm_bf16={ref * 1e6:.1f}us "
                          f"fm_fp8={fm.get('fm_fp8', float('nan')) * 1e6:.1f}us best: {top}",
                          flush=True)  # fmt: skip
                del p
                torch.cuda.empty_cache()


def time_plain(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds per call with events around each call (for code that syncs the host)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


MOE_TOKENS = (1, 16, 64, 256, 1024)


def bench_moe(args: argparse.Namespace, copy_gbs: float, log: list[dict[str, Any]]) -> str:
    """DeepSeek-V2-Lite's MoE shape: 64 experts, top-6, hidden 2048, moe_intermediate 1408."""
    from engine.kernels.fused_moe import fused_moe
    from engine.kernels.reference import fused_moe_ref

    e, k, h, i = 64, 6, 2048, 1408
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) / i**0.5
    rows = []
    header = (
        "| tokens | experts touched | fused MoE us | per-expert loop us | speed-up | "
        "weight-bytes bound us | % of bound | rel err |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for t in MOE_TOKENS:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(t, e, device="cuda", generator=g)
        topk_w, topk_ids = torch.softmax(logits, -1).topk(k, dim=-1)
        touched = int(torch.unique(topk_ids).numel())
        nbytes = touched * 3 * i * h * 2 + t * h * 2 * 2 + t * k * (2 * i + h) * 2 * 2
        moe_args = (x, w13, w2, topk_w, topk_ids)
        t_ours = time_graph(functools.partial(fused_moe, *moe_args), args.calls, args.reps)
        t_loop = time_plain(functools.partial(fused_moe_ref, *moe_args), 5)
        err = rel_err(fused_moe(*moe_args), fused_moe_ref(*moe_args))
        bound = nbytes / (copy_gbs * 1e9)
        line = (
            f"| {t} | {touched} | {t_ours * 1e6:.1f} | {t_loop * 1e6:.0f} | "
            f"{t_loop / t_ours:.1f}x | {bound * 1e6:.1f} | {100 * bound / t_ours:.0f}% | "
            f"{err:.1e} |"
        )
        print(line, flush=True)
        rows.append(line)
        log.append({"moe": t, "t": t_ours, "loop": t_loop, "bound": bound, "err": err})
    return header + "\n" + "\n".join(rows) + "\n\n" + bench_moe_decode(args, copy_gbs, log)


MOE_DECODE_TOKENS = (1, 2, 4)


def bench_moe_decode(args: argparse.Namespace, copy_gbs: float, log: list[dict[str, Any]]) -> str:
    """Decode batches as the engine runs them (V2-Lite, top-6 plus the 2 shared-expert slots,
    the default tiles), against the weight-bytes bound as above."""
    from engine.kernels import fused_moe as fm
    from engine.kernels.reference import fused_moe_ref
    from engine.layers.moe import append_shared_experts

    e, k, h, i, slots = 64, 6, 2048, 1408, 2
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) / i**0.5
    shared = fm.SharedExperts(
        torch.randn(2 * slots * i, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5,
        torch.randn(h, slots * i, device="cuda", dtype=torch.bfloat16, generator=g) / i**0.5,
    )
    header = (
        "MoE decode, 2 shared-expert slots\n"
        "| tokens | pairs | experts touched | fused MoE us | weight-bytes bound us | % of bound | "
        "rel err |\n" + "|" + " --- |" * 7
    )
    rows = []
    for t in args.moe_decode_tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(t, e, device="cuda", generator=g)
        topk_w, topk_ids = torch.softmax(logits, -1).topk(k, dim=-1)
        w, ids = append_shared_experts(topk_w, topk_ids, e, slots)
        pairs = t * (k + slots)
        touched = int(torch.unique(topk_ids).numel()) + slots
        nbytes = touched * 3 * i * h * 2 + t * h * 2 * 2 + pairs * (2 * i + h) * 2 * 2
        moe_args = (x, w13, w2, w, ids)
        fn = functools.partial(fm.fused_moe, *moe_args, shared_experts=shared)
        t_ours = time_graph(fn, args.calls, args.reps)
        err = rel_err(fn(), fused_moe_ref(*moe_args, shared_experts=shared))
        bound = nbytes / (copy_gbs * 1e9)
        line = (
            f"| {t} | {pairs} | {touched} | {t_ours * 1e6:.1f} | {bound * 1e6:.1f} | "
            f"{100 * bound / t_ours:.0f}% | {err:.1e} |"
        )
        print(line, flush=True)
        rows.append(line)
        log.append({"moe_decode": t, "pairs": pairs, "t": t_ours, "bound": bound, "err": err})
    return header + "\n" + "\n".join(rows)


def _moe_tune_grid(block_m: int) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k, warps, stages) to try at a BLOCK_M: narrow tiles with deep pipelines
    for decode (weight streaming), wide tiles for prefill (compute)."""
    if block_m <= 16:
        return [(n, k, 4, s) for n in (16, 32, 64) for k in (128, 256) for s in (3, 4, 5)]
    if block_m <= 32:
        return [(n, k, w, s) for n in (64, 128) for k in (64, 128) for w in (4, 8) for s in (3, 4)]
    return [(n, 64, w, s) for n in (64, 128, 256) for w in (4, 8) for s in (3, 4)]


def tune_moe(args: argparse.Namespace, copy_gbs: float, log: list[dict[str, Any]]) -> None:
    """Sweep the fused MoE's tiles per GEMM (gate/up, down) on V2-Lite's shape with its two
    shared-expert slots, as the engine runs it; print the best per token count with its share
    of the weight-bytes bound (decode) and its TFLOP/s (prefill)."""
    from engine.kernels.fused_moe import (
        INLINE_ALIGN_MAX_PAIRS,
        InlineAlignment,
        MoEConfig,
        SharedExperts,
        _moe_gemm,
        moe_align_block_size,
    )
    from engine.layers.moe import append_shared_experts

    e, k, h, i, slots = 64, 6, 2048, 1408, 2
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=g) / i**0.5
    shared = SharedExperts(
        torch.randn(2 * slots * i, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5,
        torch.randn(h, slots * i, device="cuda", dtype=torch.bfloat16, generator=g) / i**0.5,
    )
    for t in args.moe_tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(t, e, device="cuda", generator=g)
        topk_w, topk_ids = torch.softmax(logits, -1).topk(k, dim=-1)
        w, ids = append_shared_experts(topk_w, topk_ids, e, slots)
        w = w.reshape(-1)
        touched = int(torch.unique(topk_ids).numel()) + slots
        flops_up, flops_down = 2 * t * (k + slots) * h * 2 * i, 2 * t * (k + slots) * h * i
        block_ms = (16,) if t <= 64 else (16, 32, 64) if t <= 512 else (64, 128)
        for gemm in ("up", "down"):
            # gate/up reads two [I, H] matrices per expert, down one
            n, mats, flops = (i, 2, flops_up) if gemm == "up" else (h, 1, flops_down)
            bound = touched * mats * i * h * 2 / (copy_gbs * 1e9)
            results = []
            for bm in block_ms:
                # As the engine runs it: few pairs align inside the GEMM programs.
                align = (
                    InlineAlignment(ids.reshape(-1), e + slots)
                    if t * (k + slots) <= INLINE_ALIGN_MAX_PAIRS
                    else moe_align_block_size(ids, e + slots, bm)
                )
                act = x.new_empty((t * (k + slots), i))
                out = x.new_empty((t * (k + slots), h))
                for bn, bk, warps, stages in _moe_tune_grid(bm):
                    cfg = MoEConfig(bm, bn, bk, warps, stages)
                    if gemm == "up":
                        fn = functools.partial(_moe_gemm, x, w13, act, w, align, k + slots, i,
                                               True, True, False, cfg, shared.gate_up)  # fmt: skip
                    else:
                        fn = functools.partial(_moe_gemm, act, w2, out, w, align, k + slots, h,
                                               False, False, True, cfg, shared.down)  # fmt: skip
                    try:
                        secs = time_graph(fn, args.calls, 3)
                    except Exception as exc:  # noqa: BLE001 (out of shared memory etc.)
                        print(f"  skip {gemm} {cfg}: {type(exc).__name__}", flush=True)
                        continue
                    results.append((secs, cfg))
                    log.append({"tune_moe": gemm, "tokens": t, "cfg": list(cfg), "t": secs})
            results.sort(key=lambda r: r[0])
            top = ", ".join(
                f"{s * 1e6:.1f}us {tuple(c)} ({100 * bound / s:.0f}% bw, {flops / s / 1e12:.0f} TF)"
                for s, c in results[:4]
            )
            print(f"TUNE_MOE t={t} {gemm} (n={n}): {top}", flush=True)


FP8_BMM_BATCHES = (1, 16, 64, 256)


def bench_fp8_bmm(args: argparse.Namespace, copy_gbs: float, log: list[dict[str, Any]]) -> str:
    """V2-Lite's absorbed GEMMs (16 heads) as the model calls them: W_UK, x [B, H, 128] @
    w_kc [H, 128, 512] into a [B, H, 512] view; W_UV, x [B, H, 512] @ w_vc^T (w_vc [H, 128, 512])
    into [B, H, 128]. bf16 `torch.bmm` against the e4m3 kernel (`--tune-fp8-bmm`: also its best
    tiles). Bound = bytes moved (weights, scales, x read, out written) / copy bandwidth."""
    from engine.kernels.fp8_bmm import bmm_fp8
    from engine.kernels.reference import bmm_fp8_ref
    from engine.layers.fp8_bmm import quantize_per_channel

    h, nope, v, r = 16, 128, 128, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    w_kc = torch.randn(h, nope, r, device=dev, dtype=bf16, generator=g) / nope**0.5
    w_vc = torch.randn(h, v, r, device=dev, dtype=bf16, generator=g) / r**0.5
    q_kc, q_vc = quantize_per_channel(w_kc, 1), quantize_per_channel(w_vc, 2)
    gemms = {  # name: (K, N, bf16 weight [H, K, N], fp8 weight [H, K, N], scale [H, N])
        "W_UK": (nope, r, w_kc, q_kc.weight, q_kc.scale),
        "W_UV": (r, v, w_vc.transpose(1, 2), q_vc.weight.transpose(1, 2), q_vc.scale),
    }
    header = (
        "| GEMM | B | bf16 bmm us | fp8 us | speed-up | fp8 bound us | fp8 % of bound | "
        "bf16 % of its bound | best tiles (b, n, k) us | rel err |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    rows = []
    for name, (k, n, w, wq, scale) in gemms.items():
        for b in args.fp8_bmm_batches:
            x = torch.randn(b, h, k, device=dev, dtype=bf16, generator=g).transpose(0, 1)
            out = torch.empty(b, h, n, device=dev, dtype=bf16).transpose(0, 1)
            t_bf16 = time_graph(functools.partial(torch.bmm, x, w, out=out), args.calls, args.reps)
            t_fp8 = time_graph(functools.partial(bmm_fp8, x, wq, scale, out), args.calls, args.reps)
            act = h * b * (k + n) * 2
            bound_fp8 = (h * k * n + h * n * 4 + act) / (copy_gbs * 1e9)
            bound_bf16 = (h * k * n * 2 + act) / (copy_gbs * 1e9)
            err = rel_err(bmm_fp8(x, wq, scale), bmm_fp8_ref(x, wq, scale))
            best = "-"
            if args.tune_fp8_bmm:
                best_t, best_cfg = t_fp8, "default"
                for bb, bn, bk in _fp8_bmm_tiles(b, k, n):
                    fn = functools.partial(
                        bmm_fp8, x, wq, scale, out, block_b=bb, block_n=bn, block_k=bk
                    )
                    t = time_graph(fn, args.calls, args.reps)
                    if t < best_t:
                        best_t, best_cfg = t, f"({bb}, {bn}, {bk})"
                best = f"{best_cfg} {best_t * 1e6:.1f}"
            line = (
                f"| {name} | {b} | {t_bf16 * 1e6:.1f} | {t_fp8 * 1e6:.1f} | "
                f"{t_bf16 / t_fp8:.2f}x | {bound_fp8 * 1e6:.2f} | "
                f"{100 * bound_fp8 / t_fp8:.0f}% | {100 * bound_bf16 / t_bf16:.0f}% | {best} | "
                f"{err:.1e} |"
            )
            print(line, flush=True)
            rows.append(line)
            log.append({"fp8_bmm": name, "b": b, "bf16": t_bf16, "fp8": t_fp8, "bound": bound_fp8})
    return header + "\n" + "\n".join(rows)


def _fp8_bmm_tiles(b: int, k: int, n: int) -> list[tuple[int, int, int]]:
    blocks_b = [x for x in (16, 32, 64) if x <= max(16, b)]
    blocks_n = [x for x in (16, 32, 64, 128) if x <= n]
    blocks_k = [x for x in (32, 64, 128, 256) if x <= k]
    return [(bb, bn, bk) for bb in blocks_b for bn in blocks_n for bk in blocks_k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tune", action="store_true", help="sweep MLA configs instead of the table")
    ap.add_argument("--tune-moe", action="store_true", help="sweep fused MoE tiles per GEMM")
    ap.add_argument(
        "--moe-tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256, 512, 2048, 8192]
    )
    ap.add_argument(
        "--moe-decode-tokens", type=int, nargs="+", default=list(MOE_DECODE_TOKENS),
        help="MoE decode table (with the 2 shared-expert slots) at these token counts",
    )  # fmt: skip
    ap.add_argument("--no-mla", action="store_true")
    ap.add_argument("--no-moe", action="store_true")
    ap.add_argument("--no-fp8-bmm", action="store_true")
    ap.add_argument("--fp8-bmm-only", action="store_true", help="only the FP8 bmm table")
    ap.add_argument("--tune-fp8-bmm", action="store_true", help="FP8 bmm: also sweep tiles")
    ap.add_argument("--fp8-bmm-batches", type=int, nargs="+", default=list(FP8_BMM_BATCHES))
    ap.add_argument("--heads", type=int, nargs="+", default=list(HEADS))
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=["ours_bf16", "ours_fp8"],
        help="for --tune: ours_bf16, ours_fp8 (paged), ours_bf16_p1, ours_fp8_p1 (page size 1)",
    )
    ap.add_argument(
        "--gluon-only", action="store_true", help="for --tune: only the Gluon kernel's configs"
    )
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    ap.add_argument("--calls", type=int, default=20, help="calls captured per graph")
    ap.add_argument("--reps", type=int, default=10, help="graph replays timed")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--pv-regs", action="store_true",
        help="mla_decode.GLUON_PV_REGS_TOKENS 0: the engine's FP8 pick reads V into registers "
        "at any size",
    )  # fmt: skip
    ap.add_argument(
        "--slots-ahead2", action="store_true",
        help="mla_decode.GLUON_SLOTS_AHEAD 2: the Gluon kernels' loader reads slot ids two "
        "tiles ahead at page size 1",
    )  # fmt: skip
    ap.add_argument(
        "--q-one-term", action="store_true",
        help="mla_decode.GLUON_Q_ONE_TERM: the FP8 register-V form quantizes q as one e4m3 term",
    )  # fmt: skip
    args = ap.parse_args()
    if args.q_one_term:
        md.GLUON_Q_ONE_TERM = True
    if args.pv_regs:
        md.GLUON_PV_REGS_TOKENS = 0
    if args.slots_ahead2:
        md.GLUON_SLOTS_AHEAD = 2
    if args.fp8_bmm_only:
        args.no_mla = args.no_moe = True
    assert torch.cuda.is_available(), "needs a GPU"
    t0 = time.time()
    log: list[dict[str, Any]] = []
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    tables = [f"copy bandwidth: {copy_gbs:.0f} GB/s"]
    if args.tune_moe:
        tune_moe(args, copy_gbs, log)
    elif args.tune:
        tune_mla(args, log)
    elif not args.no_mla:
        tables.append(bench_mla(args, copy_gbs, log))
    if not args.no_moe and not args.tune and not args.tune_moe:
        tables.append(bench_moe(args, copy_gbs, log))
    if not args.no_fp8_bmm and not args.tune and not args.tune_moe:
        tables.append(bench_fp8_bmm(args, copy_gbs, log))
    print(f"\ntotal {time.time() - t0:.0f} s\n")
    print("\n\n".join(tables))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
        json.dump(log, f, default=str)


if __name__ == "__main__":
    main()
