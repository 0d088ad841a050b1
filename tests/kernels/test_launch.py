"""engine.kernels.launch: the compiled-kernel cache in front of Triton's launch path.

On CPU the kernels run through the interpreter, where `launch` always takes Triton's own path;
the cache logic is checked here with a stand-in kernel (Triton's binder and compiled-kernel
interface, recorded calls). On a GPU, the real kernels launched both ways must agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from engine.kernels import launch as launch_mod
from engine.kernels.launch import launch, set_fast_launch


class FakeCompiled:
    function = 7
    packed_metadata = ("meta",)

    def __init__(self, calls: list[tuple[str, Any]], scratch: int = 0) -> None:
        self.run = Launcher(calls, scratch)


class Launcher:
    """Triton 3.6's CudaLauncher: `__call__` allocates scratch, then calls `launch`."""

    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = True

    def __init__(self, calls: list[tuple[str, Any]], scratch: int) -> None:
        self.calls = calls
        self.global_scratch_size = scratch

    def __call__(self, *args: Any) -> None:
        self.calls.append(("cached", args))

    def launch(self, *args: Any) -> None:
        self.calls.append(("cached launch", args))


class FakeKernel:
    """Triton's JITFunction as `launch` uses it: `device_caches[device][-1]` is the binder,
    `kernel[grid](...)` the normal path (which returns the compiled kernel)."""

    def __init__(self, scratch: int = 0) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.compiled = FakeCompiled(self.calls, scratch)
        self.device_caches = {0: ({}, {}, None, None, self._bind)}

    @staticmethod
    def _bind(x: Any, n: int, BLOCK: int, **options: Any) -> tuple[Any, Any, Any]:
        spec = [("*fp32", x.data_ptr() % 16 == 0), ("i32", n == 1), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "BLOCK": BLOCK}, spec, options

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> FakeCompiled:
            self.calls.append(("triton", (grid, args, kwargs)))
            return self.compiled

        return run


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(launch_mod, "_compiled", {})
    monkeypatch.setattr(launch_mod, "_ENABLED", True)
    monkeypatch.setattr(launch_mod, "_DIRECT", True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    return launch_mod


def test_second_launch_goes_to_the_compiled_launch(fast: Any) -> None:
    k, x = FakeKernel(), torch.zeros(8)
    launch(k, (4,), x, 5, BLOCK=64, num_warps=4)
    launch(k, (3, 2), x, 5, BLOCK=64, num_warps=4)
    assert [c[0] for c in k.calls] == ["triton", "cached launch"]
    # grid padded to 3 dims, the stream, the function, cooperative grid and PDL flags, no
    # scratch, the packed metadata, no launch metadata or hooks, then every bound argument
    head = (3, 2, 1, 1234, 7, False, True, None, None, ("meta",), None, None, None)
    assert k.calls[1][1] == (*head, x, 5, 64)


@pytest.mark.parametrize("why", ["scratch", "another Triton"])
def test_the_launcher_is_called_whole(fast: Any, monkeypatch: Any, why: str) -> None:
    """A launcher that needs scratch memory, or one of a Triton other than CHECKED_TRITON,
    is called as Triton calls it (its own __call__), not its compiled launch."""
    k, x = FakeKernel(scratch=256 if why == "scratch" else 0), torch.zeros(8)
    if why == "another Triton":
        monkeypatch.setattr(launch_mod, "_DIRECT", False)
    launch(k, (4,), x, 5, BLOCK=64)
    launch(k, (4,), x, 5, BLOCK=64)
    assert [c[0] for c in k.calls] == ["triton", "cached"]
    assert k.calls[1][1] == (4, 1, 1, 1234, 7, ("meta",), None, None, None, x, 5, 64)


def test_only_a_checked_triton_turns_it_on(monkeypatch: Any) -> None:
    import triton

    monkeypatch.delenv("ENGINE_FAST_LAUNCH", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert launch_mod._enabled_by_default()
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert not launch_mod._enabled_by_default()
    monkeypatch.setenv("ENGINE_FAST_LAUNCH", "1")  # forced on
    assert launch_mod._enabled_by_default()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # never under the interpreter
    assert not launch_mod._enabled_by_default()


def test_a_new_specialization_or_option_takes_triton_path(fast: Any) -> None:
    k, x = FakeKernel(), torch.zeros(8)
    launch(k, (1,), x, 5, BLOCK=64, num_warps=4)
    launch(k, (1,), x, 1, BLOCK=64, num_warps=4)  # n == 1 specializes differently
    launch(k, (1,), x, 5, BLOCK=128, num_warps=4)  # another constexpr
    launch(k, (1,), x, 5, BLOCK=64, num_warps=8)  # another launch option
    launch(k, (1,), x, 9, BLOCK=64, num_warps=4)  # same specialization as the first
    assert [c[0] for c in k.calls] == ["triton"] * 4 + ["cached launch"]


def test_misses_after_the_warm_up_are_reported(
    fast: Any, monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(launch_mod, "_warm", False)
    monkeypatch.setattr(launch_mod, "_late", {})
    k, x = FakeKernel(), torch.zeros(8)
    launch(k, (1,), x, 5, BLOCK=64)  # during the warm-up: not reported
    launch_mod.mark_warm()
    launch(k, (1,), x, 9, BLOCK=64)  # cached: not reported
    with caplog.at_level("WARNING", logger="engine.kernels.launch"):
        launch(k, (1,), x, 1, BLOCK=64)  # a new specialization after the warm-up
    late = launch_mod.late_compiles()
    assert len(late) == 1 and late[0].startswith("FakeKernel (")
    assert "new specialization after the warm-up" in caplog.text
    k.compiled = object()  # not launchable: not cached, so it misses every time
    launch(k, (1,), x, 5, BLOCK=32)
    launch(k, (1,), x, 5, BLOCK=32)
    assert len(launch_mod.late_compiles()) == 2  # reported once
    launch_mod.mark_warm(False)  # a new engine starting: its compiles are not late
    launch(k, (1,), x, 5, BLOCK=16)
    assert len(launch_mod.late_compiles()) == 2


def test_batch_sized_ints_are_not_specialized() -> None:
    """The integer arguments that follow the batch are in do_not_specialize, by names the
    kernels have (Triton ignores a name that matches no argument). Read in a process without
    the interpreter, whose kernels keep no specialization settings."""
    code = """
import json
from engine.kernels import fused_moe, moe_router
ks = [moe_router._gate_logits_kernel, moe_router._moe_router_kernel,
      fused_moe._moe_align_kernel, fused_moe._moe_place_kernel, fused_moe._moe_gemm_kernel]
print(json.dumps({k.__name__: [sorted(k.do_not_specialize), k.arg_names] for k in ks}))
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    expected = {
        "_gate_logits_kernel": ["T", "stride_s"],
        "_moe_router_kernel": ["T", "num_splits", "stride_s"],
        "_moe_align_kernel": ["max_blocks", "num_pairs"],
        "_moe_place_kernel": ["num_pairs"],
        "_moe_gemm_kernel": ["num_pairs"],
    }
    for name, names in expected.items():
        settings, arg_names = got[name]
        assert settings == names and set(names) <= set(arg_names), name


def test_hooks_callable_grids_and_off_take_triton_path(fast: Any, monkeypatch: Any) -> None:
    from triton import knobs

    k, x = FakeKernel(), torch.zeros(8)
    launch(k, (1,), x, 5, BLOCK=64)
    launch(k, lambda meta: (1,), x, 5, BLOCK=64)  # type: ignore[arg-type]
    chain = knobs.HookChain()
    chain.add(lambda *a: None)  # a profiler's hook
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    launch(k, (1,), x, 5, BLOCK=64)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())
    set_fast_launch(False)
    launch(k, (1,), x, 5, BLOCK=64)
    assert [c[0] for c in k.calls] == ["triton"] * 4


def test_interpreter_never_caches() -> None:
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not launch_mod.fast_launch_enabled()
    else:
        pytest.skip("runs under the interpreter")


@pytest.mark.cuda
def test_cached_launches_match_triton_path() -> None:
    """The real kernels, launched through the cache and through Triton's path, give the same
    output, across shapes that change the specialization (rows of 1, unaligned views)."""
    from engine.kernels.norm import fused_add_rms_norm

    dev = torch.device("cuda")
    w = torch.randn(2048, device=dev, dtype=torch.bfloat16)
    for rows in (1, 7, 512, 1, 7):
        base = torch.randn(rows, 2050, device=dev, dtype=torch.bfloat16)
        x = base[:, 1:2049]  # a view 2 bytes off alignment
        r = torch.randn(rows, 2048, device=dev, dtype=torch.bfloat16)
        set_fast_launch(True)
        got = fused_add_rms_norm(x, r, w, 1e-6)
        got2 = fused_add_rms_norm(x, r, w, 1e-6)  # the cached path for certain
        set_fast_launch(False)
        want = fused_add_rms_norm(x, r, w, 1e-6)
        set_fast_launch(True)
        for a, b, c in zip(got, got2, want, strict=True):
            assert torch.equal(a, c) and torch.equal(b, c)
    assert launch_mod.fast_launch_enabled() and launch_mod._compiled  # the cache was used


class PdlKernel(FakeKernel):
    """A kernel with a USE_PDL constexpr (the binder takes it as a keyword)."""

    @staticmethod
    def _bind(x: Any, n: int, BLOCK: int, **options: Any) -> tuple[Any, Any, Any]:
        use = options.pop("USE_PDL")
        spec = [("*fp32", True), ("i32", n == 1), ("constexpr", BLOCK), ("constexpr", use)]
        return {"x": x, "n": n, "BLOCK": BLOCK, "USE_PDL": use}, spec, options


@pytest.mark.parametrize("active", [False, True])
def test_pdl_sets_the_constexpr_and_the_launch_option_only_where_active(
    fast: Any, monkeypatch: Any, active: bool
) -> None:
    monkeypatch.setattr(launch_mod, "pdl_active", lambda device=None: active)
    k, x = PdlKernel(), torch.zeros(8)
    launch(k, (2,), x, 5, BLOCK=64, pdl=True)
    _, (_, _, kwargs) = k.calls[0]
    assert kwargs["USE_PDL"] is active
    assert ("launch_pdl" in kwargs) is active and kwargs.get("launch_pdl", True) is True
    plain = FakeKernel()
    launch(plain, (2,), x, 5, BLOCK=64)  # not a PDL kernel: neither is passed
    assert plain.calls[0][1][2] == {"BLOCK": 64}


def test_pdl_is_off_without_cuda_or_when_turned_off(monkeypatch: Any) -> None:
    monkeypatch.setattr(launch_mod, "_PDL_WANTED", launch_mod._PDL_WANTED)  # restored after
    launch_mod.set_pdl(False)
    assert not launch_mod.pdl_active()
    launch_mod.set_pdl(True)
    if not torch.cuda.is_available():
        assert not launch_mod.pdl_active()
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not launch_mod._PDL_WANTED  # the interpreter never runs PDL launches
