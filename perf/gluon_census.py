"""Compile the Gluon FP8 MLA decode kernel for Hopper without a GPU and count its PTX.

`engine.kernels.mla_decode_gluon` is a warp-specialized kernel: a loader warp gathering tiles
with cp.async into an mbarrier ring, converter warps, and one warp group running e4m3 and fp16
wgmmas. Gluon has no interpreter, so CPU machines can only compile it; this prints what the
compiler made of it for sm_90 (instruction counts, shared memory, and the register spills of
Triton's own ptxas). Use the GPU's Triton
(3.6) to see what it would run there:

    PYTHONPATH=/tmp/tri36 .venv/bin/python perf/gluon_census.py [--page 64] [--stages 3]

`--wide` compiles the bf16 kernel of 64 heads a program (`mla_decode_gluon_wide`) instead;
`--bf16` the 16-head kernel over a bf16 pool (no converter warps).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels import mla_decode_gluon, mla_decode_gluon_wide  # noqa: E402

PATTERNS = {
    "wgmma e4m3": r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.e4m3\.e4m3",
    "wgmma f16": r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.f16\.f16",
    "wgmma bf16": r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16",
    "cp.async 16B": r"cp\.async\.cg\.shared\.global",
    "cp.async arrive": r"cp\.async\.mbarrier\.arrive",
    "mbarrier wait": r"mbarrier\.try_wait",
    "cvt e4m3x2": r"cvt\.rn\.f16x2\.e4m3x2",
    "prmt": r"prmt\.b32",
    "setmaxnreg": r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+",
    "local memory": r"(?:ld|st)\.local",
    "stmatrix": r"stmatrix\.sync\.aligned\.\w+",
    "shared stores": r"st\.shared\.[\w.]+",
    "shared loads": r"ld\.shared\.[\w.]+",
    "shared 16B loads": r"ld\.shared\.v4\.b32",
    "bar.sync": r"bar\.sync",
    "pdl wait": r"griddepcontrol\.wait",
    "pdl launch": r"griddepcontrol\.launch_dependents",
    "merge release": r"red\.global\.gpu\.release\.add",
    "merge acquire": r"ld\.global\.gpu\.acquire",
    "merge reset": r"atom\.global\.gpu\.relaxed\.exch",
}
_INTS = (
    "stride_qb stride_qh stride_kv stride_table stride_mob stride_moh stride_mos stride_mlb "
    "stride_mlh num_heads num_splits"
).split()
# Arguments Triton's launcher would mark 16-byte aligned (pointers, strides of 16).
_ALIGNED = (
    "q_ptr kv_ptr table_ptr mid_o_ptr mid_lse_ptr stride_qb stride_qh stride_kv stride_table "
    "stride_mob stride_moh stride_mos"
).split()


def compile_kernel(
    page_size: int = 1,
    stages: int = 2,
    v_stages: int = 2,
    q_residual: bool = True,
    v_rows: int = 64,
    heads: int = 16,
    pdl: bool = True,
    pv_e4m3: bool = False,
    bf16: bool = False,
    merge_chunks: int = 0,
    merge_s_pad: int = 1,
    pv_regs: bool = False,
    ids_ahead: int = 1,
    loader_warps: int = 1,
) -> Any:
    """`mla_decode_fp8_ws_kernel` as the engine launches it (bf16 q, DeepSeek's 512 + 64), over
    an e4m3 pool or (`bf16`) a bf16 one; `merge_chunks` > 0: with the split merge inside."""
    sig = {
        "q_ptr": "*bf16", "kv_ptr": "*bf16" if bf16 else "*fp8e4nv", "table_ptr": "*i32",
        "row_idx_ptr": "*i64",
        "seq_lens_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "qk_scale": "fp32",
        "k_scale_ptr": "*fp32", **dict.fromkeys(_INTS, "i32"), "out_ptr": "*bf16",
        "counter_ptr": "*i32", "stride_ob": "i32", "stride_oh": "i32",
    }  # fmt: skip
    consts: dict[str, Any] = {
        "C": 512, "R": 64, "PAGE_SIZE": page_size, "SLOT_TABLE": page_size == 1,
        "HAS_ROW_IDX": page_size == 1, "STAGES": stages, "V_STAGES": v_stages,
        "V_ROWS": v_rows, "Q_RESIDUAL": q_residual, "HEADS": heads, "PV_E4M3": pv_e4m3,
        "MERGE_CHUNKS": merge_chunks, "MERGE_S_PAD": merge_s_pad,
        "USE_PDL": pdl, "PV_REGS": pv_regs, "IDS_AHEAD": ids_ahead, "LOADER_WARPS": loader_warps,
    }  # fmt: skip
    return _compile(mla_decode_gluon.mla_decode_fp8_ws_kernel, sig, consts)


def compile_wide(
    page_size: int = 1,
    stages: int = 2,
    fp8: bool = False,
    q_residual: bool = True,
    pdl: bool = True,
) -> Any:
    """`mla_decode_wide_kernel` (64 heads a program; bf16 or e4m3 pool) as the engine launches
    it."""
    sig = {
        "q_ptr": "*bf16", "kv_ptr": "*fp8e4nv" if fp8 else "*bf16", "table_ptr": "*i32",
        "row_idx_ptr": "*i64", "seq_lens_ptr": "*i32", "mid_o_ptr": "*fp32",
        "mid_lse_ptr": "*fp32", "qk_scale": "fp32", "k_scale_ptr": "*fp32",
        **dict.fromkeys(_INTS, "i32"),
    }  # fmt: skip
    consts: dict[str, Any] = {
        "C": 512, "R": 64, "PAGE_SIZE": page_size, "SLOT_TABLE": page_size == 1,
        "HAS_ROW_IDX": page_size == 1, "STAGES": stages, "Q_RESIDUAL": fp8 and q_residual,
        "USE_PDL": pdl,
    }  # fmt: skip
    return _compile(mla_decode_gluon_wide.mla_decode_wide_kernel, sig, consts)


@gluon.jit
def _transposer_conflicts() -> None:
    """Prints the shared-memory bank conflicts (excess wavefronts an access) of the e4m3-PV
    transposer's loads (`TRANSPOSE_LAYOUT` from the 128-byte-swizzled ring) and stores (its
    relabelled registers into a 128-byte-swizzled V^T slot; a tile fills half of each row,
    modelled here as both halves, one register bit apart)."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8)
    src = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], layout)
    x = src.load(mla_decode_gluon.TRANSPOSE_LAYOUT)
    gl.static_print("  transposer load conflicts:", gl.bank_conflicts(x.type, src.type))
    z = mla_decode_gluon._v_transposed(x)
    both = gl.reshape(gl.permute(gl.join(z, z), (0, 2, 1)), [128, 128])
    dst = gl.allocate_shared_memory(gl.float8e4nv, [128, 128], layout)
    gl.static_print("  transposer store conflicts:", gl.bank_conflicts(both.type, dst.type))


@gluon.jit
def _v_regs_conflicts() -> None:
    """Prints the shared-memory bank conflicts of the register-V loads (`pv_regs`:
    `_v_regs_layout`, 16 tokens of a 128-byte-swizzled e4m3 tile of a 512 latent)."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8)
    src = gl.allocate_shared_memory(gl.float8e4nv, [16, 512], layout)
    x = src.load(mla_decode_gluon._v_regs_layout(512))
    gl.static_print("  register-V load conflicts:", gl.bank_conflicts(x.type, src.type))


@gluon.jit
def _v8_regs_conflicts() -> None:
    """The same for PV as e4m3 wgmmas (`pv_regs` with `pv_e4m3`: `_v8_regs_layout`, a whole
    tile)."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8)
    src = gl.allocate_shared_memory(gl.float8e4nv, [64, 512], layout)
    x = src.load(mla_decode_gluon._v8_regs_layout(512))
    gl.static_print("  register-V load conflicts:", gl.bank_conflicts(x.type, src.type))


def transposer_conflicts(fn: Any = None) -> None:
    """Compile `_transposer_conflicts` (or `fn`; its prints are the report: traced anew each
    time, not taken from Triton's cache)."""
    from triton import knobs

    src = GluonASTSource(fn=fn or _transposer_conflicts, signature={}, constexprs={}, attrs={})
    with knobs.compilation.scope():
        knobs.compilation.always_compile = True
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def _compile(fn: Any, sig: dict[str, str], consts: dict[str, Any]) -> Any:
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    src = GluonASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in _ALIGNED},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def ptxas_report(ptx: str) -> tuple[int | None, bool | None]:
    """What ptxas (Triton's own, sm_90a) says of this PTX: the bytes it spills to local memory
    (register spills show only there, not in the PTX), and whether it serializes the wgmmas
    (its warning C7514: each then waits for the one before). Nones where this Triton has no
    such ptxas."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception:  # noqa: BLE001 (an older Triton: another name, or no ptxas)
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [path, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "kernel.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    found = re.findall(r"(\d+) bytes spill stores", log)
    serialized = re.search(r"C7514|instructions are serialized", log) is not None
    return (max(int(n) for n in found) if found else None), serialized


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--page", type=int, default=1)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--v-stages", type=int, default=2)
    ap.add_argument("--v-rows", type=int, default=64, help="tokens of an fp16 V ring slot")
    ap.add_argument("--one-term", action="store_true", help="q as one e4m3 term")
    ap.add_argument("--heads", type=int, default=16, help="heads a program (16 or 32)")
    ap.add_argument("--wide", action="store_true", help="the kernel of 64 heads a program")
    ap.add_argument("--fp8", action="store_true", help="with --wide: over an e4m3 pool")
    ap.add_argument("--bf16", action="store_true", help="the 16-head kernel over a bf16 pool")
    ap.add_argument("--no-pdl", action="store_true", help="as launched without PDL")
    ap.add_argument("--pv-e4m3", action="store_true", help="PV as an e4m3 wgmma (V transposed)")
    ap.add_argument("--pv-regs", action="store_true", help="PV with V^T from registers")
    ap.add_argument("--ids-ahead", type=int, default=1, help="slot ids read 1 or 2 tiles ahead")
    ap.add_argument("--loader-warps", type=int, default=1, help="the loader's warps (1, 2, 4)")
    ap.add_argument(
        "--merge-splits", type=int, default=0, help="with the split merge inside, of this many"
    )
    args = ap.parse_args()
    pdl = not args.no_pdl
    if args.wide:
        kernel = compile_wide(args.page, args.stages, args.fp8, not args.one_term, pdl)
    else:
        chunks, s_pad = (0, 1)
        if args.merge_splits > 1:
            chunks, s_pad = mla_decode_gluon.merge_shape(args.merge_splits, 512)
        kernel = compile_kernel(
            args.page, args.stages, args.v_stages, not args.one_term, args.v_rows, args.heads,
            pdl, args.pv_e4m3, args.bf16, chunks, s_pad, args.pv_regs, args.ids_ahead,
            args.loader_warps,
        )  # fmt: skip
    ptx = kernel.asm["ptx"]
    threads = re.search(r"\.reqntid (\d+)", ptx)
    print(
        f"triton {triton.__version__}, target sm_90, shared KB {kernel.metadata.shared / 1024:.1f}"
        f", threads {threads[1] if threads else '?'}"
    )
    for name, pattern in PATTERNS.items():
        found = re.findall(pattern, ptx)
        print(f"  {name}: {len(found)} {sorted(set(found))[:4]}")
    spills, serialized = ptxas_report(ptx)
    print(f"  ptxas spill stores: {'n/a' if spills is None else spills} bytes")
    print(f"  ptxas wgmma serialized: {'n/a' if serialized is None else serialized}", flush=True)
    if args.pv_e4m3 and not args.pv_regs:
        transposer_conflicts()
    if args.pv_regs:
        transposer_conflicts(_v8_regs_conflicts if args.pv_e4m3 else _v_regs_conflicts)


if __name__ == "__main__":
    main()
