"""Compile a warp-specialized Gluon pipeline for Hopper without a GPU and count its PTX.

Issue 16's FP8 target needs what FlashMLA's FP8 kernel has and `tl.dot` code cannot get: warps
that load (and transform) KV tiles while others run the MMAs (perf/RESULTS.md, run AI). Gluon
(`triton.experimental.gluon`, in the Triton 3.6 of the H200) gives explicit warp partitions.
This is the first piece of that route, compiled only (not run, not part of the engine):
a one-warp loader partition gathers 64-token e4m3 latent tiles by slot id (page size 1) with
cp.async into a two-deep shared-memory ring, signalling mbarriers; the default partition
(one warp group) runs K q^T as an e4m3 wgmma straight from the ring. Use the GPU's Triton
(3.6) to see what it would run there:

    PYTHONPATH=/tmp/tri36 .venv/bin/python perf/gluon_census.py
"""

from __future__ import annotations

import re
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mbarrier
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

# The gather into shared memory, by its Triton 3.9 name or its Triton 3.6 one.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
BLOCK_N = gl.constexpr(64)  # tokens a tile (the wgmma's M)
LATENT = gl.constexpr(512)
HEADS = gl.constexpr(16)
RING = gl.constexpr(2)  # tiles in flight


@gluon.jit
def _loader(kv_ptr, slots_ptr, n_tiles, ring, ready, empty):
    """One warp: for each tile, wait for its ring slot to be free, gather its rows by slot id
    (16-byte cp.async), and have the copies arrive on the slot's `ready` barrier."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [1, 1], [1, 0])
    for i in range(n_tiles):
        s = i % RING
        mbarrier.wait(empty.index(s), ((i // RING) & 1) ^ 1)
        offs_t = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        slot = gl.load(slots_ptr + offs_t).to(gl.int64)
        offs_c = gl.arange(0, LATENT, layout=gl.SliceLayout(0, layout))
        rows = kv_ptr + slot[:, None] * LATENT + offs_c[None, :]
        _async_load(ring.index(s), rows)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _scores(q_smem, out_ptr, n_tiles, ring, ready, empty):
    """The default partition: scores^T [tokens, heads] of each tile as an e4m3 wgmma, the
    ring slot released right after (a sum of them stands in for the softmax and PV)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEADS, 32]
    )
    total = gl.zeros([BLOCK_N, HEADS], gl.float32, acc_layout)
    for i in range(n_tiles):
        s = i % RING
        mbarrier.wait(ready.index(s), (i // RING) & 1)
        acc = gl.zeros([BLOCK_N, HEADS], gl.float32, acc_layout)
        acc = warpgroup_mma(ring.index(s), q_smem.permute((1, 0)), acc)
        mbarrier.arrive(empty.index(s))
        total += acc
    offs_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    offs_h = gl.arange(0, HEADS, layout=gl.SliceLayout(0, acc_layout))
    gl.store(out_ptr + offs_t[:, None] * HEADS + offs_h[None, :], total)


@gluon.jit
def pipeline_kernel(q_ptr, kv_ptr, slots_ptr, out_ptr, n_tiles):
    mma_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8)
    ring = gl.allocate_shared_memory(gl.float8e4nv, [RING, BLOCK_N, LATENT], mma_smem)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [HEADS, LATENT], mma_smem)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])
    offs_h = gl.arange(0, HEADS, layout=gl.SliceLayout(1, q_layout))
    offs_c = gl.arange(0, LATENT, layout=gl.SliceLayout(0, q_layout))
    q_smem.store(gl.load(q_ptr + offs_h[:, None] * LATENT + offs_c[None, :]))
    fence_async_shared()
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(RING):
        mbarrier.init(ready.index(s), count=32)  # the loader warp's lanes
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize(
        [
            (_scores, (q_smem, out_ptr, n_tiles, ring, ready, empty)),
            (_loader, (kv_ptr, slots_ptr, n_tiles, ring, ready, empty)),
        ],
        [1],  # loader warps
        [40],  # loader registers a thread
    )


PATTERNS = {
    "wgmma": r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.e4m3\.e4m3",
    "cp.async 16B": r"cp\.async\.cg\.shared\.global",
    "cp.async arrive": r"cp\.async\.mbarrier\.arrive",
    "mbarrier wait": r"mbarrier\.try_wait",
    "setmaxnreg": r"setmaxnreg\.\w+",
}


def compile_pipeline() -> Any:
    sig = {
        "q_ptr": "*fp8e4nv", "kv_ptr": "*fp8e4nv", "slots_ptr": "*i32", "out_ptr": "*fp32",
        "n_tiles": "i32",
    }  # fmt: skip
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 3)}
    src = GluonASTSource(fn=pipeline_kernel, signature=sig, constexprs={}, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def main() -> None:
    kernel = compile_pipeline()
    ptx = kernel.asm["ptx"]
    print(
        f"triton {triton.__version__}, target sm_90, shared KB {kernel.metadata.shared / 1024:.1f}"
    )
    for name, pattern in PATTERNS.items():
        found = re.findall(pattern, ptx)
        print(f"  {name}: {len(found)} {sorted(set(found))}")


if __name__ == "__main__":
    main()
