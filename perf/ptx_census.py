"""Compile the MLA decode kernel (stage 1) for Hopper without a GPU and count what its PTX does.

Triton compiles for a named target on any machine, so the structure of a kernel variant (which
MMA instructions, how the KV tiles and the slot ids are loaded, how deep the copies are
pipelined) can be read before a GPU session measures it. The counts are static (prologue, loop
and epilogue together), not timings. Use the Triton the GPU machine has (3.6 on the H200), e.g.
`pip install --target /tmp/tri36 --no-deps triton==3.6.0` and `PYTHONPATH=/tmp/tri36`.

    .venv/bin/python perf/ptx_census.py                  # every variant below
    .venv/bin/python perf/ptx_census.py p1 --keep /tmp   # names containing "p1"; PTX kept
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.kernels.mla_decode import _mla_decode_stage1  # noqa: E402

_STRIDES = (
    "stride_qb", "stride_qh", "stride_kv", "stride_table",
    "stride_mob", "stride_moh", "stride_mos", "stride_mlb", "stride_mlh",
)  # fmt: skip

# name: (page size, fp8, slots ahead, block_h, block_n, warps, stages, halves, fp8 dots,
# q residual); 16 heads use one 16-head group, 128 heads the 64-head group of default_config.
# "ahead" as the kernel's default (`resolve_slots_ahead`) unless the name says otherwise;
# "halves": the latent as two dots (`MLADecodeConfig.halves`, the 16-head default since run AF);
# "dots": QK as an e4m3 dot (`MLADecodeConfig.fp8_dots`) with q as two e4m3 terms
# (`q_residual`), the 16-head FP8 default since run AH; "one term": without the second;
# "pairs": the two terms through one dot (`q_pairs`, an eleventh field; the default since run
# AI); "8 warps" (2 stages) was 1.5x slower than 4 warps in run AI.
VARIANTS: dict[str, tuple[Any, ...]] = {
    "h16 paged bf16": (64, False, 0, 16, 64, 4, 3, False, False, False),
    "h16 paged bf16 ahead": (64, False, 1, 16, 64, 4, 3, False, False, False),
    "h16 paged bf16 n32": (64, False, 0, 16, 32, 4, 3, False, False, False),
    "h16 paged bf16 ahead n32": (64, False, 1, 16, 32, 4, 3, False, False, False),
    "h16 p1 bf16": (1, False, 1, 16, 64, 4, 3, False, False, False),
    "h16 p1 bf16 inline": (1, False, 0, 16, 64, 4, 3, False, False, False),
    "h16 p1 bf16 n32": (1, False, 1, 16, 32, 4, 3, False, False, False),
    "h16 p1 bf16 inline n32": (1, False, 0, 16, 32, 4, 3, False, False, False),
    "h16 paged fp8": (64, True, 1, 16, 64, 4, 3, False, False, False),
    "h16 p1 fp8": (1, True, 1, 16, 64, 4, 3, False, False, False),
    "h16 p1 fp8 inline": (1, True, 0, 16, 64, 4, 3, False, False, False),
    "h16 p1 bf16 n32 halves": (1, False, 1, 16, 32, 4, 3, True, False, False),
    "h16 p1 fp8 halves": (1, True, 1, 16, 64, 4, 3, True, False, False),
    "h16 p1 fp8 dots": (1, True, 1, 16, 64, 4, 3, False, True, True),
    "h16 p1 fp8 halves dots 2 stages": (1, True, 1, 16, 64, 4, 2, True, True, True),
    "h16 p1 fp8 halves dots 2 stages one term": (1, True, 1, 16, 64, 4, 2, True, True, False),
    "h16 p1 fp8 halves dots 2 stages pairs": (1, True, 1, 16, 64, 4, 2, True, True, True, True),
    "h16 p1 fp8 halves pairs 8 warps": (1, True, 1, 16, 64, 8, 2, True, True, True, True),
    "h16 paged fp8 dots": (64, True, 1, 16, 64, 4, 3, False, True, True),
    "h128 paged bf16": (64, False, 0, 64, 64, 8, 2, False, False, False),
    "h128 paged fp8": (64, True, 1, 64, 64, 8, 2, False, False, False),
    "h128 paged fp8 dots 1 stage one term": (64, True, 1, 64, 64, 8, 1, False, True, False),
}

PATTERNS = {
    "mma.sync": r"\bmma\.sync",
    "wgmma": r"wgmma\.mma_async",
    "wgmma shapes": r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)",
    "wgmma waits": r"wgmma\.wait_group\.sync\.aligned (\d+)",
    "cp.async 16B": r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10",
    "cp.async 4B": r"cp\.async\.ca\.shared\.global \[[^]]*\], \[[^]]*\], 0x4",
    "cp.async waits": r"cp\.async\.wait_group\s+(\d+)",
    "ld.global scalar": r"ld\.global\.b32",
    "ld.global vector": r"ld\.global[.\w]*\.v\d",
    "ldmatrix": r"ldmatrix",
    "st.shared.b8": r"st\.shared\.b8",
    "ld.shared.b8": r"ld\.shared\.b8",
    "cvt e4m3": r"cvt\.rn\.f16x2\.e4m3x2",
    "bar.sync": r"bar\.sync",
}


def compile_kernel(page: int, fp8: bool, ahead: int, block_h: int, block_n: int, warps: int,
                   stages: int, halves: bool = False, fp8_dots: bool = False,
                   q_residual: bool = False, q_pairs: bool = False) -> Any:  # fmt: skip
    """The compiled kernel: its PTX in `.asm["ptx"]`, its shared memory in `.metadata.shared`."""
    sig: dict[str, str] = {
        "q_ptr": "*bf16", "kv_ptr": "*fp8e4nv" if fp8 else "*bf16", "table_ptr": "*i32",
        "row_idx_ptr": "*i64", "seq_lens_ptr": "*i32", "mid_o_ptr": "*fp32",
        "mid_lse_ptr": "*fp32", "qk_scale": "fp32", "k_scale_ptr": "*fp32",
    }  # fmt: skip
    sig.update({n: "i32" for n in (*_STRIDES, "num_heads", "num_splits")})
    consts: dict[str, Any] = dict(
        C=512, R=64, PAGE_SIZE=page, SLOT_TABLE=False, BLOCK_H=block_h, BLOCK_N=block_n,
        HAS_ROW_IDX=page == 1, IS_FP8=fp8, USE_PTX=fp8, UPCAST=False, SLOTS_AHEAD=ahead,
        HALVES=halves, FP8_DOTS=fp8_dots, Q_RESIDUAL=q_residual, Q_PAIRS=q_pairs,
        USE_PDL=False,
    )  # fmt: skip
    sig.update({c: "constexpr" for c in consts})
    names = list(sig)
    # Pointers and the leading strides are multiples of 16, as Triton specializes them at run time.
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in _STRIDES[:7]]
    src = ASTSource(
        fn=_mla_decode_stage1,
        signature=sig,
        constexprs={(names.index(c),): v for c, v in consts.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    options = dict(num_warps=warps, num_stages=stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def census(ptx: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, pattern in PATTERNS.items():
        found = re.findall(pattern, ptx)
        if found and isinstance(found[0], str) and "(" in pattern:
            out[name] = {k: found.count(k) for k in sorted(set(found))}
        else:
            out[name] = len(found)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="*", help="variants whose name one of these regexes finds")
    ap.add_argument("--keep", help="write each variant's PTX into this directory")
    ap.add_argument("--json", help="write the counts here too")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("the kernels must be compiled: run without TRITON_INTERPRET=1")
    print(f"triton {triton.__version__}, target sm_90")
    results: dict[str, dict[str, Any]] = {}
    for name, params in VARIANTS.items():
        if a.only and not any(re.search(pattern, name) for pattern in a.only):
            continue
        compiled = compile_kernel(*params)
        ptx = compiled.asm["ptx"]
        if a.keep:
            (Path(a.keep) / (name.replace(" ", "_") + ".ptx")).write_text(ptx)
        results[name] = {"shared KB": round(compiled.metadata.shared / 1024, 1), **census(ptx)}
        counts = "; ".join(f"{k} {v}" for k, v in results[name].items() if v)
        print(f"{name}: {counts}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
