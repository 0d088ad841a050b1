"""Where an MLA decode call's time goes at 16 heads: the whole call (stage 1 and the split
merge, as the engine runs them), stage 1 alone, the merge alone, and the call at other split
counts, beside FlashMLA in the same process, over bf16 and FP8 caches on the engine's layout
(page size 1) through the Gluon kernels as the engine picks them.

    PYTHONPATH=. python3 perf/bench_decode_parts.py [--points 16x16384 64x16384 ...]
        [--splits 4 8 16] [--fp8-forms regs4 ...] [--l2]

Run AQ left the FP8 kernel at 0.99x FlashMLA FP8 at batch 16 and 64, ctx 16K, where both
programs per request fill 128 of 132 SMs; this shows what the merge and the split count cost
there. us a call (CUDA-graph replays, `bench_kernels.time_graph`); "merge inside": the call with
the split merge inside stage 1 (`MLADecodeConfig.merge_inside`) instead of `merge_splits`
after it. With `--l2` every request reads the first request's rows, which then stay in L2: the
calls take about what their compute takes, a card's memory bandwidth nearly out of the way (the
H100 and H200 have the same SMs and clocks, so this bounds on one what the other can reach).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_kernels  # noqa: E402

from engine.kernels import mla_decode as md  # noqa: E402
from engine.kernels import mla_decode_gluon  # noqa: E402
from engine.kernels.utils import choose_num_kv_splits, merge_splits  # noqa: E402

HEADS = 16


def parse_point(text: str) -> tuple[int, int]:
    batch, ctx = text.split("x")
    return int(batch), int(ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--points", nargs="+", type=parse_point,
        default=[(16, 4096), (16, 16384), (64, 16384), (66, 16384), (128, 4096)],
        help="batch x ctx",
    )  # fmt: skip
    ap.add_argument("--splits", type=int, nargs="*", default=[], help="also these split counts")
    ap.add_argument(
        "--fp8-forms", nargs="*", default=[],
        help="also FP8 calls of these forms: regsN (V from registers, N e4m3 tiles), regs8N "
        "(the same, PV as e4m3 wgmmas with P in e4m3), conv (the converter warps' form with 3 "
        "e4m3 tiles), with an 'a2' suffix slot ids read two tiles "
        "ahead, with a 'q1' suffix q as one e4m3 term (q1 alone: the engine's form with one "
        "term; a2 alone: the engine's form with ids two tiles ahead), with an 'l2' or 'l4' "
        "suffix 2 or 4 loader warps; '@N' after a form: N splits a request (regs2@16: two "
        "programs an SM where they fit)",
    )  # fmt: skip
    ap.add_argument(
        "--l2", action="store_true",
        help="every request reads the first one's rows (one context's cache, held in L2): what "
        "the kernels take with the memory's bandwidth nearly out of the way",
    )  # fmt: skip
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"GPU: {torch.cuda.get_device_name()}, {sms} SMs")
    head = "| kv | batch | ctx | FlashMLA us | splits | call us | call, merge inside us |"
    head += " stage 1 us | merge us | other splits: us | FP8 forms: us |"
    print(head)
    print("| --- " * (head.count("|") - 1) + "|")
    for batch, ctx in args.points:
        p = bench_kernels.MLAPoint(batch, ctx)
        if args.l2:
            p.req_pool_indices.zero_()
            p.block_table.copy_(p.block_table[:1].clone().expand_as(p.block_table))
        for kv_name in ("bf16", "fp8"):
            print(measure(p, kv_name, args), flush=True)
        del p
        torch.cuda.empty_cache()


def measure(p: bench_kernels.MLAPoint, kv_name: str, args: argparse.Namespace) -> str:
    """One table row: FlashMLA, the call, stage 1 and the merge alone, other split counts."""
    c, r = bench_kernels.C, bench_kernels.R
    scale = (c + r) ** -0.5
    batch, ctx, q = p.batch, p.ctx, p.q(HEADS)
    fp8 = kv_name == "fp8"
    kv = (p.cache8 if fp8 else p.cache).view(-1, c + r)
    k_scale = p.k_scale if fp8 else None
    cfg = md.gluon_config(HEADS, batch, ctx, fp8=fp8)
    # The split count `mla_decode` picks for the Gluon kernel (its heads and tokens a program).
    splits = choose_num_kv_splits(
        batch, HEADS, ctx, cfg.gluon_heads, mla_decode_gluon.BLOCK_N.value, waves=cfg.waves,
        min_tokens_per_split=cfg.min_split_tokens,
    )  # fmt: skip
    call = functools.partial(
        md.mla_decode, q, kv.unsqueeze(1), p.req_to_token, p.req_pool_indices, p.seq_lens, c,
        scale, k_scale=k_scale, max_seq_len=ctx, config=cfg,
    )  # fmt: skip
    mid_o = torch.empty(batch, HEADS, splits, c, dtype=torch.float32, device="cuda")
    mid_lse = torch.empty(batch, HEADS, splits, dtype=torch.float32, device="cuda")
    out = q.new_empty(batch, HEADS, c)
    stage1 = functools.partial(
        mla_decode_gluon.launch_stage1, q, kv, p.req_to_token, p.req_pool_indices, p.seq_lens,
        mid_o, mid_lse, scale * md._LOG2E, k_scale, 1, cfg.num_stages, cfg.gluon, cfg.v_rows,
        cfg.q_residual, cfg.gluon_heads, cfg.pv_e4m3, pv_regs=cfg.pv_regs,
    )  # fmt: skip
    merge = functools.partial(merge_splits, mid_o, mid_lse, out)

    def t(fn: Callable[[], object]) -> str:
        return f"{bench_kernels.time_graph(fn, args.calls, args.reps) * 1e6:.1f}"

    fms = bench_kernels.flashmla_fns(p, q, scale)
    fm = fms.get("fm_fp8" if fp8 else "fm_bf16")
    inside = functools.partial(call, config=cfg._replace(merge_inside=True))
    cells = [kv_name, batch, ctx, t(fm) if fm else "-", splits, t(call), t(inside), t(stage1)]
    if splits > 1:
        stage1()
        merge()
        err = (out.float() - call().float()).abs().max().item()
        assert err < 1e-2, f"stage 1 + merge differ from the call by {err}"
        cells.append(t(merge))
    else:
        cells.append("-")
    others = [s for s in args.splits if s != splits]
    cells.append(", ".join(f"{s}: {t(functools.partial(call, num_kv_splits=s))}" for s in others))
    forms = []
    for name in args.fp8_forms if fp8 else []:
        form, _, count = name.partition("@")
        alt_call = functools.partial(call, config=form_config(cfg, form))
        if count:
            alt_call = functools.partial(alt_call, num_kv_splits=int(count))
        err = (alt_call().float() - call().float()).abs().max().item()
        forms.append(f"{name}: {t(alt_call)} (err {err:.1e})")
    cells.append(", ".join(forms) or "-")
    return "| " + " | ".join(str(x) for x in cells) + " |"


def form_config(cfg: md.MLADecodeConfig, form: str) -> md.MLADecodeConfig:
    """`--fp8-forms`' names: regsN (`pv_regs`, N e4m3 tiles), regs8N (the same with PV as
    e4m3 wgmmas, `pv_e4m3`), conv (the converter form of large calls: 3 e4m3 tiles, V in
    32-token slots), an a2 suffix (slot ids two tiles ahead, `slots_ahead` 2), a q1 suffix
    (one q term) and an lN suffix (N loader warps), in that order (regs4a2q1, regs84l4)."""
    if form[-2:] in ("l2", "l4"):
        cfg, form = cfg._replace(loader_warps=int(form[-1])), form[:-2]
    if form.endswith("q1"):
        cfg, form = cfg._replace(q_residual=False), form[:-2]
    if form.endswith("a2"):
        cfg, form = cfg._replace(slots_ahead=2), form[:-2]
    if form == "conv":
        cfg = cfg._replace(pv_regs=False, num_stages=3, gluon=3, v_rows=32)
    elif form.startswith("regs"):
        e4m3 = form.startswith("regs8")
        stages = int(form[5:] if e4m3 else form[4:])
        cfg = cfg._replace(pv_regs=True, pv_e4m3=e4m3, num_stages=stages, gluon=1, v_rows=64)
    elif form:
        raise SystemExit(f"unknown form {form!r}")
    return cfg


if __name__ == "__main__":
    main()
