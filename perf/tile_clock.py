"""Where a tile's cycles go in the register-V FP8 decode kernel (`MLADecodeConfig.pv_regs`).

`perf/tile_clock.patch` puts SM clock stamps (`%clock64`) into `mla_decode_gluon`: the
attention warp group stamps each tile of its loop at ten points, the loader warp before and
after its wait for a free ring slot, and every program writes them to
`mla_decode_gluon.TIMING` (set here; without it the patched kernel is the committed one). The
stamps cost registers (about 100 bytes of spills under Triton 3.6), so the call's time printed
beside them is taken with the stamps off. Apply the patch on a scratch tree, on a Hopper GPU:

    git apply perf/tile_clock.patch && PYTHONPATH=. python3 perf/tile_clock.py
    git apply -R perf/tile_clock.patch

Per point (batch x ctx, the cache from HBM or held in L2 as in `bench_decode_parts.py --l2`):
mean cycles a tile (the first two and last two tiles of each program left out) and the
stretches between stamps: waiting for the tile's data, issuing QK, each of PV's four 16-token
steps (V loaded, converted and its wgmmas issued), the barrier and QK's wait, the softmax with
P's store, PV's wait and the loop's back edge; the loader's wait for a free slot and the rest
of its tile (issuing the copies).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_decode_parts  # noqa: E402
import bench_kernels  # noqa: E402

from engine.kernels import mla_decode as md  # noqa: E402
from engine.kernels import mla_decode_gluon as g  # noqa: E402
from engine.kernels.utils import choose_num_kv_splits  # noqa: E402

HEADS = 16
# The stretches: (name, stamp at its start, stamp at its end); -1 is the next tile's stamp 0.
STRETCHES = [
    ("wait_ready", 0, 1), ("qk_issue", 1, 8), ("pv0", 8, 9), ("pv1", 9, 10), ("pv2", 10, 11),
    ("pv3", 11, 2), ("bar+qk_wait", 2, 3), ("softmax+P", 3, 4), ("pv_wait", 4, 5),
    ("back_edge", 5, -1),
]  # fmt: skip


def run(batch: int, ctx: int, l2: bool, stages: int, form: str = "regs") -> str:
    """One point's line; `form` "regs8": PV as e4m3 wgmmas (`pv_e4m3`; its one PV issue is
    stretch pv0, pv1-pv3 empty)."""
    assert hasattr(g, "TIMING"), "apply perf/tile_clock.patch first"
    p = bench_kernels.MLAPoint(batch, ctx)
    if l2:
        p.req_pool_indices.zero_()
    c, r = bench_kernels.C, bench_kernels.R
    q, kv = p.q(HEADS), p.cache8.view(-1, c + r)
    # The engine's pick for this point, as the register-V form with `stages` ring tiles, and
    # the split count `mla_decode` takes for it.
    cfg = bench_decode_parts.form_config(md.gluon_config(HEADS, batch, ctx), f"{form}{stages}")
    splits = choose_num_kv_splits(
        batch, HEADS, ctx, cfg.gluon_heads, g.BLOCK_N.value, waves=cfg.waves,
        min_tokens_per_split=cfg.min_split_tokens,
    )  # fmt: skip
    mid_o = torch.empty(batch, HEADS, splits, c, dtype=torch.float32, device="cuda")
    mid_lse = torch.empty(batch, HEADS, splits, dtype=torch.float32, device="cuda")
    programs, tiles = batch * splits, g.DBG_TILES.value
    qk_scale = (c + r) ** -0.5 * md._LOG2E

    def call() -> None:
        g.launch_stage1(
            q, kv, p.req_to_token, p.req_pool_indices, p.seq_lens, mid_o, mid_lse, qk_scale,
            p.k_scale, 1, cfg.num_stages, cfg.gluon, cfg.v_rows, cfg.q_residual,
            cfg.gluon_heads, cfg.pv_e4m3, pv_regs=cfg.pv_regs,
        )  # fmt: skip

    g.TIMING = torch.zeros(programs * tiles, 16, dtype=torch.int64, device="cuda")
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    t = g.TIMING.view(programs, tiles, 16).cpu().double()
    g.TIMING = None
    us = bench_kernels.time_graph(call, 20, 10) * 1e6
    n = ctx // splits // g.BLOCK_N.value
    assert n <= tiles, f"{n} tiles a program; the patch stamps {tiles}"
    cur, nxt = t[:, 2 : n - 2], t[:, 3 : n - 1]
    at = lambda k: nxt[..., 0] if k < 0 else cur[..., k]  # noqa: E731
    cells = " ".join(f"{name}={(at(b) - at(a)).mean():.0f}" for name, a, b in STRETCHES)
    tile = nxt[..., 0] - cur[..., 0]
    where = "L2" if l2 else "HBM"
    slot_wait, rest = cur[..., 7] - cur[..., 6], nxt[..., 6] - cur[..., 7]
    return (
        f"{batch} x {ctx} {where}, {form}, {stages} tiles, {splits} splits: {us:.1f} us a call "
        f"(stamps off); cycles a tile {tile.mean():.0f} (median {tile.median():.0f}): {cells}; "
        f"loader slot wait {slot_wait.mean():.0f}, rest {rest.mean():.0f}"
    )


if __name__ == "__main__":
    print(torch.cuda.get_device_name())
    for batch, ctx in ((16, 16384), (64, 16384)):
        for l2 in (True, False):
            print(run(batch, ctx, l2, 5), flush=True)
    print(run(128, 16384, False, 5), flush=True)
    for batch in (16, 64):
        print(run(batch, 16384, True, 4, "regs8"), flush=True)
