"""Launching the engine's Triton kernels with less host work than `kernel[grid](...)`.

An eager forward launches about 11 Triton kernels per decoder layer; on the H200 a lone 512-token
prefill of DeepSeek-V2-Lite took 34.5 ms of host time for 12.1 ms of GPU work, with Triton's
launch path (`JITFunction.run`) the largest share (perf/RESULTS.md, "Host time of a lone
prefill").
Every launch there re-derives the specialization of each argument (native code), then builds a
string key (`str(options)`), checks the kernel's globals, canonicalizes the grid through a few
driver proxies and builds launch metadata for hooks nobody set.

`launch(kernel, grid, *args, **kwargs)` keeps the first step (Triton's own binder, so the
specialization is exactly Triton's: dtypes, 16-byte alignment, ints equal to 1 or divisible by
16, constexpr values) and caches the compiled kernel under that specialization, so a repeated
launch goes straight to the compiled launcher. A miss (a new specialization) takes Triton's
normal path, which compiles and launches, and records the result. Anything unusual (the CPU
interpreter, a launch hook such as a profiler's, a grid given as a function) takes the normal
path every time, and so does every launch under a Triton other than the versions in
CHECKED_TRITON (its internals are private and change between releases: 3.9's launcher, for
one, wraps arguments for its sanitizer); ENGINE_FAST_LAUNCH=1 forces the cache on there,
ENGINE_FAST_LAUNCH=0 turns it off.

A new specialization is a compile (seconds, the first time on a machine) or a load from Triton's
disk cache (tens of ms) in the middle of a step. The engine warms its kernels up at start and
then calls `mark_warm()`; a miss after that is logged as a warning with the kernel and what it
took (`late_compiles()` lists them), so that a stall in serving names its cause (on the cached
path only: with it off, Triton's own path compiles without a word). Integer
arguments that follow the batch (token and pair counts) are in their kernels'
`do_not_specialize`, so that they do not multiply the variants a warm-up must reach: Triton
would otherwise build one for each of "equal to 1", "divisible by 16" and "other" (a serving
run on the H200 showed prefill steps of 0.4-3 s on the first batches of a size). Pointers are
specialized on 16-byte alignment, so the step's packed inputs keep every field aligned
(model_runner.pack_int64), and a count that follows the batch is a runtime loop bound rather
than a constexpr (the router's split count).

Programmatic dependent launch (PDL, Hopper and later): a batch-1 decode step is about 15 small
kernels a layer, each waiting for the one before it to finish, start its programs and reach
DRAM. `launch(..., pdl=True)` starts such a kernel (one with a `USE_PDL` constexpr) while its
predecessor still runs. The contract every such kernel keeps (`engine.kernels.utils.pdl_wait`):
- before `pdl_wait` it reads only what no launch of the last two wrote (its weights, the step's
  inputs, the outputs of kernels two or more launches back) and writes nothing;
- it calls `gdc_launch_dependents` only after its own wait, so when kernel k starts, kernel
  k - 2 and everything before it have finished.
A kernel launched without PDL (cuBLAS, torch's own) waits for its predecessor as always, and a
PDL kernel after one of those starts once it has finished. ENGINE_PDL=0 turns PDL off.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import torch


def is_interpreter() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1).
    (Defined here, where engine.kernels.utils imports it from: utils imports this module.)"""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


CHECKED_TRITON = ("3.6.",)  # the device's Triton, where the cached path was run and compared


def _checked_triton() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return str(triton.__version__).startswith(CHECKED_TRITON)


def _missing_internals() -> str | None:
    """What the cached path needs of Triton and this one lacks, or None."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError as e:
        return f"triton internals not found: {e}"
    if not hasattr(JITFunction, "create_binder") or not hasattr(knobs, "runtime"):
        return "JITFunction has no create_binder"
    return None


def _enabled_by_default() -> bool:
    setting = os.environ.get("ENGINE_FAST_LAUNCH")
    wanted = setting != "0" if setting is not None else _checked_triton()
    return wanted and not is_interpreter() and _missing_internals() is None


_ENABLED = _enabled_by_default()
_DIRECT = _checked_triton()  # whether _entry may call the launcher's compiled `launch` itself
_PDL_WANTED = os.environ.get("ENGINE_PDL", "1") != "0" and not is_interpreter()

# (kernel id, device, *specialization, *launch options) -> (launcher, arguments before the grid's
# and stream's successors: see _entry)
_compiled: dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]] = {}
_runtime: Any = None  # triton.knobs.runtime, imported on first use
_warm = False  # set by mark_warm: later misses are reported
# key -> "kernel (ms)" of each miss after mark_warm, once per key (a compiled kernel that is not
# cached would miss on every launch)
_late: dict[tuple[Any, ...], str] = {}
logger = logging.getLogger(__name__)


def fast_launch_enabled() -> bool:
    return _ENABLED


def set_fast_launch(enabled: bool) -> None:
    """Turn the cached path on or off (benchmarks compare both; tests check it off)."""
    global _ENABLED
    _ENABLED = enabled and not is_interpreter()


def mark_warm(warm: bool = True) -> None:
    """The engine's warm-up is over: report every new specialization from here on (False: an
    engine is starting, its compiles are expected)."""
    global _warm
    _warm = warm


def set_pdl(enabled: bool) -> None:
    """Launch `pdl=True` kernels with programmatic dependent launch where the GPU has it
    (benchmarks compare both; the setting a CUDA graph was captured with stays in it)."""
    global _PDL_WANTED
    _PDL_WANTED = enabled and not is_interpreter()


def pdl_active(device: int | None = None) -> bool:
    """Whether `launch(..., pdl=True)` uses PDL on this CUDA device (the current one)."""
    if not _PDL_WANTED or not _cuda_available():
        return False
    return _pdl_supported(torch._C._cuda_getDevice() if device is None else device)


@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.cache
def _pdl_supported(index: int) -> bool:
    """sm_90+ and a Triton with the grid-dependency intrinsics and the launch option."""
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    try:
        import triton.language.extra.cuda as tl_cuda
    except ImportError:
        return False
    return hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")


def late_compiles() -> list[str]:
    """The kernels that met a new specialization after `mark_warm`, with the ms each took."""
    return list(_late.values())


def launch(
    kernel: Any, grid: tuple[int, ...], *args: Any, pdl: bool = False, **kwargs: Any
) -> None:
    """`kernel[grid](*args, **kwargs)`, through the compiled-kernel cache when possible.
    `pdl`: the kernel keeps the PDL contract above (its `USE_PDL` constexpr is set here)."""
    global _runtime
    if pdl:
        use = pdl_active()
        kwargs["USE_PDL"] = use
        if use:
            kwargs["launch_pdl"] = True
    if not _ENABLED or callable(grid):
        kernel[grid](*args, **kwargs)
        return
    if _runtime is None:
        from triton import knobs

        _runtime = knobs.runtime
    if _has_hooks(_runtime.launch_enter_hook) or _has_hooks(_runtime.launch_exit_hook):
        kernel[grid](*args, **kwargs)
        return
    device = torch._C._cuda_getDevice()
    # device_caches[device]: (kernel cache, key cache, target, backend, binder)
    bound_args, specialization, options = kernel.device_caches[device][-1](*args, **kwargs)
    key = (id(kernel), device, *specialization, *options.items())
    entry = _compiled.get(key)
    if entry is None:
        t0 = time.perf_counter()
        compiled = kernel[grid](*args, **kwargs)  # compiles (once) and launches
        if _launchable(compiled):
            _compiled[key] = _entry(compiled)
        if _warm and key not in _late:
            _report_late(key, kernel, specialization, 1e3 * (time.perf_counter() - t0))
        return
    run, head = entry
    n = len(grid)
    run(
        grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
        torch._C._cuda_getCurrentRawStream(device), *head, *bound_args.values(),
    )  # fmt: skip


def _report_late(key: tuple[Any, ...], kernel: Any, specialization: Any, ms: float) -> None:
    name = getattr(kernel, "__name__", type(kernel).__name__)
    _late[key] = f"{name} ({ms:.0f} ms)"
    logger.warning(
        "Triton kernel %s met a new specialization after the warm-up (%.0f ms in this step): %s",
        name, ms, specialization,
    )  # fmt: skip


def _entry(compiled: Any) -> tuple[Any, tuple[Any, ...]]:
    """What a cached launch calls after (grid x, y, z, stream). Triton 3.6's CUDA launcher
    (`CudaLauncher.__call__`) only allocates scratch memory (none for these kernels) and calls
    its compiled `launch` with the cooperative-grid and PDL flags: call that directly then.
    Otherwise the launcher object itself: (function, packed metadata, no launch metadata, no
    enter and exit hooks)."""
    runner = compiled.run
    tail = (compiled.packed_metadata, None, None, None)
    flags = ("launch", "launch_cooperative_grid", "launch_pdl")
    if (
        _DIRECT
        and all(hasattr(runner, a) for a in flags)
        and not (
            getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1)
        )
    ):
        head = (compiled.function, runner.launch_cooperative_grid, runner.launch_pdl, None, None)
        return runner.launch, head + tail
    return runner, (compiled.function, *tail)


def _has_hooks(hook: Any) -> bool:
    """Whether a launch hook is set: None, or Triton 3.6's empty `HookChain`, is none (Triton
    itself then still builds launch metadata and calls the empty chain twice a launch)."""
    return hook is not None and getattr(hook, "calls", True) != []


def _launchable(compiled: Any) -> bool:
    """A compiled kernel with the launcher and handles the cached path calls (an async
    compile's future, or another Triton's kernel object, is not cached)."""
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
