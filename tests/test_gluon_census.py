"""The Gluon MLA decode kernels compile for sm_90 on any machine (perf/gluon_census.py). In the
FP8 kernel the loader's gathers signal their mbarrier, QK stays an e4m3 wgmma and PV an fp16
one, the partitions get their own register budgets, ptxas spills no more than the measured
forms do, the partitions that touch global memory keep the PDL contract's wait, and the
rings fit in shared memory; the kernel of 64 heads a program keeps its wgmma shapes and
fits. Their results are checked on a Hopper GPU (tests/kernels/test_mla_decode_gluon.py). Each
compiles in a process of its own: Gluon kernels are compiled, never interpreted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels.mla_decode import MLADecodeConfig, gluon_config

REPO = Path(__file__).resolve().parents[1]
H200_SHARED_KB = 227


def _flags(cfg: MLADecodeConfig) -> list[str]:
    rings = ["--stages", str(cfg.num_stages), "--v-stages", str(cfg.gluon)]
    heads = ["--heads", str(cfg.gluon_heads)] if cfg.gluon_heads != 16 else []
    terms = [] if cfg.q_residual else ["--one-term"]
    regs = ["--pv-regs"] if cfg.pv_regs else []
    return [*rings, "--v-rows", str(cfg.v_rows), *heads, *terms, *regs]


def _census(flags: list[str], pdl_partitions: int, spill_limit: int) -> tuple[dict[str, int], str]:
    """perf/gluon_census.py's counts and report for these flags, after the checks every form
    shares: the loader's gathers signal their mbarrier, the partitions get their own register
    budgets, no explicit local memory, the partitions that touch global memory keep the PDL
    contract's wait, ptxas (Triton's own, sm_90a) spills at most `spill_limit` bytes (register
    spills show only in its report) and leaves the wgmmas pipelined (no warning C7514), and
    the kernel fits the SM's shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(REPO / "perf" / "gluon_census.py"), *flags]
    out = subprocess.run(cmd, env=env, check=True, timeout=300, capture_output=True, text=True)
    report = out.stdout
    counts = {m[1]: int(m[2]) for m in re.finditer(r"^  ([\w. ]+): (\d+)", report, re.M)}
    assert counts["cp.async 16B"] > 0 and counts["cp.async arrive"] > 0, report
    assert counts["setmaxnreg"] > 0 and counts["local memory"] == 0, report
    assert counts["pdl wait"] == pdl_partitions, report
    assert counts["pdl launch"] == pdl_partitions, report
    spills = re.search(r"ptxas spill stores: (\d+|n/a) bytes", report)[1]  # type: ignore[index]
    if spills != "n/a":
        assert int(spills) <= spill_limit, report
    assert "ptxas wgmma serialized: True" not in report, report
    shared_kb = float(re.search(r"shared KB ([\d.]+)", report)[1])  # type: ignore[index]
    assert shared_kb <= H200_SHARED_KB, report
    return counts, report


@pytest.mark.parametrize(
    "flags",
    [
        # The engine's picks (a small call and a large one), and paged with 3 e4m3 tiles + 1 V.
        _flags(gluon_config(16, 1, 1024)),
        _flags(gluon_config(16, 128, 16384)),
        ["--page", "64", "--stages", "3", "--v-stages", "1"],
        # 32 heads a program (the pick at 128 heads for a latent the wide kernel does not
        # serve): m64n64 QK, m64n32 PV.
        _flags(gluon_config(128, 16, 4096, kv_lora_rank=256)),
    ],
)
def test_gluon_decode_kernel_compiles_for_hopper(flags: list[str]) -> None:
    # Spills (Triton 3.9): 16 bytes for the 16-head forms at page size 1 (64 with V read into
    # registers, none with Triton 3.6); 48-120 paged (the loader's page arithmetic at 80
    # registers); 200 for 32 heads a program (its [512, 32] accumulator is 128 registers a
    # thread). A change that spills more shows here. PDL: the loader and the attention
    # partition wait (the converter touches no global memory).
    limit = 256 if "--heads" in flags else 128 if "--page" in flags else 32
    limit = 80 if "--pv-regs" in flags else limit
    counts, report = _census(flags, pdl_partitions=2, spill_limit=limit)
    # QK over 576: chains of 18 k-steps of 32 (q's two terms stacked as N = 32; the first
    # tile's chain issued before the loop), PV: 8 M-blocks x 4 k-steps of 16 tokens, however
    # many V slots a tile is cut into.
    wide = "--heads" in flags  # 32 heads: N of 64 (two q terms) and 32
    qk, pv = ("m64n64k32", "m64n32k16") if wide else ("m64n32k32", "m64n16k16")
    assert counts["wgmma e4m3"] in (18, 36) and qk in report, report
    # (V read into registers: PV's 32 twice, the last tile's following the loop.)
    f16 = 64 if "--pv-regs" in flags else 32
    assert counts["wgmma f16"] == f16 and pv in report, report
    assert counts["cvt e4m3x2"] >= 128, report  # 64 x 512 a tile over 128 threads, 2 a cvt


def test_gluon_e4m3_pv_compiles_for_hopper() -> None:
    """`pv_e4m3`: PV as e4m3 wgmmas too (m64n16k32: 8 M-blocks x 2 k-steps of 32 tokens, beside
    QK's 36 m64n32k32), none in fp16; the transposer's stores go out as stmatrix, and its loads
    and stores are free of bank conflicts (`gl.bank_conflicts`; a plain 4 x 4 block transpose
    counts 7 excess wavefronts a store); q (two terms), 2 e4m3 tiles, 2 V^T slots and P fit."""
    counts, report = _census(["--pv-e4m3"], pdl_partitions=2, spill_limit=32)
    assert counts["wgmma e4m3"] == 36 + 16, report
    assert "m64n16k32" in report and "m64n32k32" in report, report
    assert counts["wgmma f16"] == 0 and counts["stmatrix"] > 0, report
    assert "transposer load conflicts: 0" in report, report
    assert "transposer store conflicts: 0" in report, report


def test_gluon_pv_regs_compiles_for_hopper() -> None:
    """`pv_regs`: V^T read from the e4m3 ring into the attention group's registers. No converter
    warps (256 threads: the attention group and the loader, padded to warp groups), PV still
    8 M-blocks x 4 k-steps of fp16 m64n16k16 wgmmas (now with A from registers; twice over: the
    last tile's PV follows the loop), each thread's
    V bytes read as 16-byte loads (4 tokens a k-step: at least 16 a tile) free of bank
    conflicts, and 5 e4m3 tiles, q and P fit. Spills: none with Triton 3.6 (the GPU's), 128
    bytes with 3.9."""
    counts, report = _census(["--pv-regs", "--stages", "5"], pdl_partitions=2, spill_limit=160)
    assert "threads 256" in report, report
    assert counts["wgmma e4m3"] == 36 and counts["wgmma f16"] == 64, report
    assert "m64n16k16" in report and counts["shared 16B loads"] >= 16, report
    assert counts["cvt e4m3x2"] >= 128, report
    assert "register-V load conflicts: 0" in report, report


def test_gluon_pv_regs_e4m3_compiles_for_hopper() -> None:
    """`pv_regs` with `pv_e4m3`: PV as e4m3 wgmmas with V^T from registers: 8 M-blocks x 2
    k-steps of m64n16k32 a tile (twice over, the last tile's after the loop) beside QK's 36,
    no fp16 wgmma and no V conversion (the cvt left are P's and q's), each thread's V bytes
    read as 16-byte loads free of bank conflicts (`_v8_regs_layout`), 5 ring tiles fit.
    Spills: none with Triton 3.6, 16 bytes with 3.9 at 4 tiles."""
    flags = ["--pv-regs", "--pv-e4m3", "--stages", "5"]
    counts, report = _census(flags, pdl_partitions=2, spill_limit=48)
    assert "threads 256" in report, report
    assert counts["wgmma e4m3"] == 36 + 32 and counts["wgmma f16"] == 0, report
    assert "m64n16k32" in report and counts["shared 16B loads"] >= 16, report
    assert counts["cvt e4m3x2"] < 64, report
    # The bytes' transpose into the A fragment: 3 PRMT an A register (64 a tile, twice over).
    assert counts["prmt"] <= 384, report
    assert "register-V load conflicts: 0" in report, report


@pytest.mark.parametrize(
    "flags", [_flags(gluon_config(16, 128, 16384)), _flags(gluon_config(16, 16, 4096))]
)
def test_gluon_slot_ids_two_tiles_ahead_compile_for_hopper(flags: list[str]) -> None:
    """`slots_ahead` 2 at page size 1 (the register-V form and the converter form): the loader
    holds two int32 ids a lane for each of the next two tiles and spreads a tile's over its
    copies' layout through a little shared memory; it spills less than one tile ahead with
    int64 ids (Triton 3.9: 12 bytes against 44, 0 against 16; 3.6: none), and the same
    copies and wgmmas go out."""
    counts, report = _census([*flags, "--ids-ahead", "2"], pdl_partitions=2, spill_limit=16)
    base, _ = _census(flags, pdl_partitions=2, spill_limit=80)
    for name in ("cp.async 16B", "wgmma e4m3", "wgmma f16", "cvt e4m3x2"):
        assert counts[name] == base[name], (name, report)
    # The ids' trip through shared memory (16 a lane read back per tile) is the two-ahead
    # loader's own.
    assert counts["shared loads"] >= base["shared loads"] + 16, report


@pytest.mark.parametrize("splits", [2, 8, 33, 64])
def test_gluon_merge_inside_compiles_for_hopper(splits: int) -> None:
    """The split merge inside the kernel: one thread publishes its split with a release
    reduction after the partition's barrier, waits with acquire loads, and the last merger
    resets the counter; without it none of these."""
    flags = ["--merge-splits", str(splits)]
    for form in ([], ["--bf16"]):
        counts, report = _census([*flags, *form], pdl_partitions=2, spill_limit=32)
        assert counts["merge release"] == 1 and counts["merge acquire"] >= 1, report
        assert counts["merge reset"] == 1, report
    counts, report = _census([], pdl_partitions=2, spill_limit=32)
    assert counts["merge release"] == counts["merge acquire"] == counts["merge reset"] == 0


def test_gluon_bf16_compiles_for_hopper() -> None:
    """The 16-head kernel over a bf16 pool (the engine's pick below 64 heads): no converter
    warps, QK as 36 bf16 m64n16k16 wgmmas a tile (each after its own tile's wait: no chain
    issued ahead) and PV as 8 M-blocks x 4 k-steps, no e4m3 or fp16 one; q, 2 ring slots and
    P fit."""
    cfg = gluon_config(16, 16, 4096, fp8=False)
    assert cfg.gluon and cfg.gluon_heads == 16 and cfg.num_stages == 2
    counts, report = _census(["--bf16"], pdl_partitions=2, spill_limit=32)
    assert counts["wgmma bf16"] == 36 + 32 and "m64n16k16" in report, report
    assert counts["wgmma e4m3"] == 0 and counts["wgmma f16"] == 0, report
    assert counts["cvt e4m3x2"] == 0, report


def test_engine_reads_v_into_registers_for_large_fp8_calls() -> None:
    """At 16 heads the engine's FP8 pick reads V into registers (4 e4m3 tiles) from
    GLUON_PV_REGS_TOKENS of work (batch x context) on, and keeps the converter below it; the
    32-head form (a latent the wide kernel does not serve) never does."""
    from engine.kernels.mla_decode import GLUON_PV_REGS_TOKENS

    large = gluon_config(16, 64, GLUON_PV_REGS_TOKENS // 64)
    assert large.pv_regs and large.num_stages == 4 and large.gluon_heads == 16
    small = gluon_config(16, 16, GLUON_PV_REGS_TOKENS // 16 - 1)
    assert not small.pv_regs and small.gluon >= 2
    assert not gluon_config(128, 16, 16384, kv_lora_rank=256).pv_regs
    assert not gluon_config(16, 128, 16384, fp8=False).pv_regs


def test_q_as_one_term_applies_to_the_register_v_form_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.kernels import mla_decode

    assert gluon_config(16, 64, 16384).q_residual  # two e4m3 terms by default
    monkeypatch.setattr(mla_decode, "GLUON_Q_ONE_TERM", True)
    assert not gluon_config(16, 64, 16384).q_residual
    small = gluon_config(16, 1, 1024)
    assert not small.pv_regs and small.q_residual


def test_engine_picks_the_wide_kernel_for_wide_fp8_calls() -> None:
    """At 128 heads the engine takes 64 heads a program from batch 8 (q as one e4m3 term, 3
    tiles), and keeps 16 at batch 1; the 32-head form serves a latent the wide kernel does not."""
    wide = gluon_config(128, 16, 4096)
    assert (wide.gluon_heads, wide.num_stages, wide.q_residual) == (64, 3, False)
    assert gluon_config(128, 8, 4096).gluon_heads == 64
    assert gluon_config(128, 1, 4096).gluon_heads == 16
    assert gluon_config(128, 16, 4096, kv_lora_rank=256).gluon_heads == 32
    assert gluon_config(16, 128, 4096).gluon_heads == 16  # fewer heads than a wide program
    # bf16: 64 heads a program where the wide kernel serves the shape, else 16.
    assert gluon_config(128, 16, 4096, fp8=False).gluon_heads == 64
    assert gluon_config(128, 16, 4096, fp8=False, kv_lora_rank=256).gluon_heads == 16
    assert gluon_config(16, 128, 4096, fp8=False).gluon_heads == 16


@pytest.mark.parametrize("page", [1, 64])
def test_gluon_wide_kernel_compiles_for_hopper(page: int) -> None:
    """The bf16 kernel of 64 heads a program (`mla_decode_gluon_wide`): QK as one m64n64k16
    chain over 576 (36 k-steps), PV as m64n256k16 in each of the two warp groups (4 k-steps of
    16 tokens each), every partition waiting under PDL, and no register spills (none at Triton
    3.9)."""
    counts, report = _census(["--wide", "--page", str(page)], pdl_partitions=3, spill_limit=32)
    assert counts["wgmma bf16"] == 36 + 2 * 4, report
    assert "m64n64k16" in report and "m64n256k16" in report, report
    assert counts["wgmma e4m3"] == 0 and counts["cvt e4m3x2"] == 0, report


@pytest.mark.parametrize("page", [1, 64])
def test_gluon_wide_fp8_kernel_compiles_for_hopper(page: int) -> None:
    """The engine's pick for wide FP8 calls (`gluon_config`: 64 heads a program, q as one e4m3
    term, 3 tiles): QK as one m64n64k32 e4m3 chain over 576 (18 k-steps), PV as m64n256k16 fp16
    in each warp group, V's latent converted from e4m3 (64 x 512 a tile over the PV group's
    128 threads, 2 a cvt); ptxas spilled 16 bytes at page size 1 and 112 paged (Triton 3.9; the
    loader's page arithmetic, as in the 16-head kernel)."""
    cfg = gluon_config(128, 64, 4096)
    flags = ["--wide", "--fp8", "--page", str(page), "--stages", str(cfg.num_stages)]
    flags += [] if cfg.q_residual else ["--one-term"]
    counts, report = _census(flags, pdl_partitions=3, spill_limit=128)
    assert counts["wgmma e4m3"] == 18 and "m64n64k32" in report, report
    assert counts["wgmma f16"] == 2 * 4 and "m64n256k16" in report, report
    assert counts["wgmma bf16"] == 0 and counts["cvt e4m3x2"] >= 128, report


def test_tile_clock_patch_applies() -> None:
    """perf/tile_clock.patch (the register-V kernel's clock stamps) still applies to the kernel
    as committed, so that perf/tile_clock.py can run on a scratch tree."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(
        ["git", "apply", "--check", "perf/tile_clock.patch"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
