"""torch.compile of the decode forward (issue 12 item 3): config, cache directory, the kernels'
custom ops, and compiled decode against the eager forward on CPU (torch-native attention, and
the Triton backend and kernels under the interpreter) and on CUDA (inside the graphs)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from test_cuda_graph import _teacher_forced_logits, v2lite_two_layers  # noqa: F401 (fixture)

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.executor import compile as tc
from engine.executor.model_runner import ModelRunner
from engine.kernels import (  # noqa: F401 (the siblings register their ops)
    custom_ops,
    custom_ops_attention,
    custom_ops_fp8,
    custom_ops_moe,
)
from engine.scheduler.batch import BatchEntry, ForwardMode, ScheduledBatch

# Where the Triton kernels run: the GPU where there is one, else the CPU under the interpreter
# (a CPU tensor cannot reach a compiled kernel on a CUDA machine).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[100 + 7 * i + j for j in range(3 + 5 * i)] for i in range(3)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# ---- config and cache directory -------------------------------------------------------------
def test_compile_config_is_validated() -> None:
    EngineConfig(enable_torch_compile=True, torch_compile_max_bs=8)
    with pytest.raises(ConfigError, match="torch_compile_max_bs must be >= 1"):
        EngineConfig(enable_torch_compile=True, torch_compile_max_bs=0)
    with pytest.raises(ConfigError, match="torch_compile_layers must be one of"):
        EngineConfig.from_dict({"enable_torch_compile": True, "torch_compile_layers": "fused"})
    with pytest.raises(ConfigError, match="torch_compile_backend must be one of"):
        EngineConfig(torch_compile_backend="cudagraphs")
    with pytest.raises(ConfigError, match="needs torch_compile_backend='inductor'"):
        EngineConfig(
            torch_compile_backend="aot_eager", torch_compile_mode="max-autotune-no-cudagraphs"
        )


def test_inductor_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg = EngineConfig()
    assert tc.inductor_cache_dir(cfg, {}) == tmp_path / "xdg" / "mla-engine" / "inductor"
    env = {tc.CACHE_ENV: str(tmp_path / "env")}
    assert tc.inductor_cache_dir(cfg, env) == tmp_path / "env"
    chosen = cfg.replace(torch_compile_cache_dir=str(tmp_path / "mine"))
    assert tc.inductor_cache_dir(chosen, env) == tmp_path / "mine"
    monkeypatch.setenv(tc.CACHE_ENV, str(tmp_path / "env"))
    assert tc.configure_compiler(chosen) == tmp_path / "mine"
    assert (tmp_path / "mine").is_dir()
    import os

    assert os.environ[tc.CACHE_ENV] == str(tmp_path / "mine")


# ---- custom ops -----------------------------------------------------------------------------
def _opcheck(op: object, args: tuple, kwargs: dict | None = None) -> None:
    # The fake implementation and the schema against the real kernel (the interpreter on CPU);
    # autograd is not used in inference.
    torch.library.opcheck(
        op,
        args,
        kwargs or {},
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_custom_ops_norm_activation_rope() -> None:
    # Every factory below makes its tensor on the kernels' device.
    with torch.device(DEVICE):
        g = torch.Generator(DEVICE).manual_seed(0)
        x = torch.randn(3, 32, generator=g)
        res = torch.randn(3, 32, generator=g)
        w = torch.rand(32, generator=g) + 0.5
        _opcheck(torch.ops.engine.rms_norm.default, (x, w, 1e-6))
        _opcheck(torch.ops.engine.fused_add_rms_norm.default, (x, res, w, 1e-6))
        _opcheck(torch.ops.engine.silu_and_mul.default, (torch.randn(3, 64, generator=g),))
        qk = torch.randn(3, 6, 16, generator=g)
        q, k = qk[:, :4], qk[:, 4:]  # strided views, as the layers pass them
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        pos = torch.tensor([0, 5, 9])
        _opcheck(torch.ops.engine.rotary_embedding.default, (pos, q, k, inv_freq, 1.0, True))
        kv_a = torch.randn(3, 32 + 16, generator=g)
        q_pe = torch.randn(3, 4, 16, generator=g)
        q_abs = torch.zeros(3, 4, 32 + 16)
        args = (kv_a, q_pe, w, 1e-6, pos, inv_freq, 1.0, True, q_abs[..., 32:])
        _opcheck(torch.ops.engine.mla_preamble.default, args)


def test_custom_ops_moe_and_attention() -> None:
    # Every factory below makes its tensor on the kernels' device.
    with torch.device(DEVICE):
        g = torch.Generator(DEVICE).manual_seed(1)
        t, h, e, inter = 3, 32, 4, 16
        x = torch.randn(t, h, generator=g)
        gate = torch.randn(e, h, generator=g)
        router = (x, gate, 2, "softmax", None, 1, 1, True, 1.0, 1)
        _opcheck(torch.ops.engine.moe_router.default, router)
        weights, ids = torch.ops.engine.moe_router(*router)
        w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.1
        w2 = torch.randn(e, h, inter, generator=g) * 0.1
        shared_gate_up = torch.randn(2 * inter, h, generator=g) * 0.1
        shared_down = torch.randn(h, inter, generator=g) * 0.1
        moe = (x, w13, w2, weights, ids, None, shared_gate_up, shared_down)
        _opcheck(torch.ops.engine.fused_moe.default, moe)

        slots, c, r, heads = 16, 32, 16, 4
        kv = torch.zeros(slots, 1, c + r)
        loc = torch.tensor([3, 7, 9])
        _opcheck(torch.ops.engine.store_mla_kv.default, (kv, loc, torch.randn(t, c + r), None))
        kv.normal_(generator=g)
        table = torch.arange(2 * 8, dtype=torch.int32).view(2, 8)
        rows, lens = torch.tensor([1, 0]), torch.tensor([5, 8])
        q = torch.randn(2, heads, c + r, generator=g)
        _opcheck(
            torch.ops.engine.mla_decode.default, (q, kv, table, rows, lens, c, 0.1, None, 8, 1)
        )
        k_buf, v_buf = torch.zeros(slots, 2, 16), torch.zeros(slots, 2, 16)
        k, v = torch.randn(t, 2, 16, generator=g), torch.randn(t, 2, 16, generator=g)
        _opcheck(torch.ops.engine.store_kv.default, (k_buf, v_buf, loc, k, v, None, None))
        qg = torch.randn(2, 4, 16, generator=g)
        gqa = (qg, k_buf, v_buf, table, rows, lens, 0.25, None, None, 8)
        _opcheck(torch.ops.engine.gqa_decode.default, gqa)


def test_layers_call_kernels_directly_when_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a trace the wrappers launch the kernel, not the op (no dispatcher per call)."""

    def refuse(*args: object) -> None:
        raise AssertionError("the op was called eagerly")

    monkeypatch.setattr(custom_ops, "_rms_norm_op", refuse)
    x, w = torch.randn(2, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    torch.testing.assert_close(
        custom_ops.rms_norm(x, w, 1e-6), torch.ops.engine.rms_norm(x, w, 1e-6)
    )


# ---- compiled decode on CPU -----------------------------------------------------------------
def _model(name: str, request: pytest.FixtureRequest) -> str:
    if name == "llama":
        return request.getfixturevalue("tiny_llama")
    return request.getfixturevalue("tiny_mla")("v2", moe=True, q_lora_rank=None)


@pytest.mark.parametrize("which", ["llama", "mla"])
def test_compiled_decode_matches_eager_torch_native(
    which: str, request: pytest.FixtureRequest
) -> None:
    """CPU, torch-native attention (run eagerly between the compiled pieces), aot_eager: the
    same greedy tokens as the eager engine, every decode step served by the compiled forward."""
    model = _model(which, request)
    common = dict(device="cpu", dtype="float32", max_total_tokens=256)
    eager = LLM(model, **common).generate(PROMPTS, GREEDY)
    llm = LLM(
        model,
        enable_torch_compile=True,
        torch_compile_backend="aot_eager",
        torch_compile_max_bs=4,
        **common,
    )
    compiled = llm.core.runner.compiled_decode
    assert compiled is not None and llm.core.runner.graph_runner is None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in eager]
    assert compiled.calls == GREEDY.max_tokens - 1 and compiled.compiled_sizes == {3}


def _runner(path: str, **overrides: object) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            model=path,
            device=DEVICE,
            dtype="float32",
            attention_backend="triton",
            enable_cuda_graph=False,  # on CUDA: the compiled forward called directly
            max_total_tokens=256,
            max_context_len=64,
            **overrides,  # type: ignore[arg-type]
        )
    )


def _decode_steps(runner: ModelRunner, steps: int) -> list[torch.Tensor]:
    """Prefill two prompts, then teacher-forced decode steps of both; the logits of each."""
    starts = [1, 100]
    prompts = PROMPTS[:2]
    entries = [
        BatchEntry(i, p, 0, list(range(starts[i], starts[i] + len(p))))
        for i, p in enumerate(prompts)
    ]
    runner.forward(ScheduledBatch(ForwardMode.EXTEND, entries))
    out = []
    for step in range(steps):
        decode = [
            BatchEntry(i, [50 + 3 * step + i], len(p) + step, [starts[i] + len(p) + step])
            for i, p in enumerate(prompts)
        ]
        out.append(runner.forward(ScheduledBatch(ForwardMode.DECODE, decode)).clone())
    return out


def _force_kernels(runner: ModelRunner) -> None:
    for m in runner.model.modules():
        if isinstance(getattr(m, "kernel", None), str):
            m.kernel = "triton"  # type: ignore[assignment]


@pytest.mark.parametrize("which", ["llama", "mla"])
def test_compiled_decode_with_kernel_ops_is_one_graph(
    which: str, request: pytest.FixtureRequest
) -> None:
    """The GPU structure on CPU: the Triton backend and every layer kernel (under the
    interpreter) as custom ops, traced into one graph (fullgraph: a graph break fails), with
    torch_compile_layers="kernels". Same logits as the eager kernels; one compilation for
    the whole run (the split-KV count is bucketed, so a longer context does not recompile)."""
    model = _model(which, request)
    eager = _runner(model)
    _force_kernels(eager)
    ref = _decode_steps(eager, 3)
    runner = _runner(
        model,
        enable_torch_compile=True,
        torch_compile_backend="aot_eager",
        torch_compile_layers="kernels",
    )
    _force_kernels(runner)
    compiled = runner.compiled_decode
    assert compiled is not None and compiled.traceable
    torch._dynamo.utils.counters.clear()
    got = _decode_steps(runner, 3)
    assert compiled.calls == 3 and compiled.compiled_sizes == {2}
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1, frames


def test_inductor_compiled_decode_mla(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real inductor at a tiny size (tens of seconds on CPU): DeepSeek-V2 with MLA and MoE,
    the Triton attention backend and the fused MoE as custom ops, the other layers' torch code
    compiled by inductor (torch_compile_layers="native", as on the GPU). What it generates goes
    to the configured cache directory."""
    model = _model("mla", request)
    eager = _runner(model)
    ref = _decode_steps(eager, 2)
    monkeypatch.setenv(tc.CACHE_ENV, str(tmp_path / "elsewhere"))  # restored after the test
    cache = tmp_path / "inductor"
    runner = _runner(
        model,
        enable_torch_compile=True,
        torch_compile_backend="inductor",
        torch_compile_cache_dir=str(cache),
    )
    for m in runner.model.modules():
        if type(m).__name__ == "Experts":
            m.kernel = "triton"  # type: ignore[assignment]
    got = _decode_steps(runner, 2)
    assert runner.compiled_decode is not None and runner.compiled_decode.calls == 2
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert any(cache.rglob("*.py")), "inductor wrote no code into the cache directory"
    assert not (tmp_path / "elsewhere").exists()


def test_traced_layers_switches_auto_layers_only(request: pytest.FixtureRequest) -> None:
    runner = _runner(_model("mla", request))
    modules = tc.layer_kernel_modules(runner.model)
    assert modules and all(type(m).__name__ != "Experts" for m in modules)
    modules[0].kernel = "triton"  # type: ignore[assignment]
    with tc.traced_layers(runner.model, "native"):
        assert modules[0].kernel == "triton"
        assert all(m.kernel == "native" for m in modules[1:])
    assert all(m.kernel == "auto" for m in modules[1:])
    with tc.traced_layers(runner.model, "kernels"):
        assert all(m.kernel == "auto" for m in modules[1:])


@pytest.mark.parametrize("compiled", [False, True])
def test_shutdown_releases_device_memory(compiled: bool, request: pytest.FixtureRequest) -> None:
    """shutdown() drops the weights, the KV pool and the compiled forward even while the runner
    is still held (a local of perf/bench_engine.py held a compiled engine's runner, and the next
    engine found 20.8 of 139.8 GiB free); once the LLM is dropped, nothing keeps the runner
    (dynamo's caches of the compiled forward included)."""
    options = dict(enable_torch_compile=compiled, torch_compile_backend="aot_eager")
    llm = LLM(
        _model("mla", request), device="cpu", dtype="float32", max_total_tokens=256, **options
    )
    llm.generate(PROMPTS, GREEDY)
    runner = llm.core.runner
    owned: list[object] = [next(runner.model.parameters()), runner.kv_pool.kv_buffer[0]]
    if compiled:
        assert runner.compiled_decode is not None and runner.compiled_decode.compiled_sizes
        owned.append(runner.compiled_decode)
    refs = [weakref.ref(x) for x in owned]
    del owned
    llm.shutdown()
    assert [r() is None for r in refs] == [True] * len(refs)
    held = weakref.ref(runner)
    del llm, runner
    gc.collect()
    assert held() is None


# ---- CUDA: compiled forward inside the graphs -----------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("layers", ["native", "kernels"])
@pytest.mark.parametrize("which", ["llama", "mla"])
def test_compile_graph_decode_matches_eager(
    which: str, layers: str, request: pytest.FixtureRequest
) -> None:
    model = _model(which, request)
    common = dict(dtype="float32", max_total_tokens=512, attention_backend="triton")
    eager = LLM(model, enable_cuda_graph=False, **common)
    llm = LLM(
        model,
        enable_cuda_graph=True,
        cuda_graph_max_bs=8,
        enable_torch_compile=True,
        torch_compile_max_bs=2,
        torch_compile_layers=layers,
        **common,
    )
    graphs = llm.core.runner.graph_runner
    assert graphs is not None and graphs.compiled_sizes == [1, 2]
    want = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert graphs.replays > 0


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("layers", "kv_cache_dtype"),
    [("native", "auto"), ("kernels", "auto"), ("native", "fp8_e4m3")],
)
def test_v2lite_compile_graph_decode_matches_eager(
    v2lite_two_layers: str,  # noqa: F811 (the fixture imported above)
    layers: str,
    kv_cache_dtype: str,
) -> None:
    """Issue 12: on the real model shape, in bf16, decode replayed from graphs that captured
    the compiled forward gives the eager path's logits within bf16 tolerance, teacher-forced
    (batch 5 padded to 8: compiled with torch_compile_max_bs=8)."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (7, 40, 130, 300, 515)]
    forced = [[rng.randrange(100, 40000) for _ in range(12)] for _ in prompts]
    common = dict(
        dtype="bfloat16",
        max_total_tokens=8192,
        max_running_requests=8,
        kv_cache_dtype=kv_cache_dtype,
    )
    eager = LLM(v2lite_two_layers, enable_cuda_graph=False, **common)
    ref = _teacher_forced_logits(eager, prompts, forced)
    del eager
    llm = LLM(
        v2lite_two_layers,
        enable_cuda_graph=True,
        cuda_graph_max_bs=8,
        enable_torch_compile=True,
        torch_compile_max_bs=8,
        torch_compile_layers=layers,
        **common,
    )
    graphs = llm.core.runner.graph_runner
    assert graphs is not None and graphs.compiled_sizes == [1, 2, 4, 8]
    got = _teacher_forced_logits(llm, prompts, forced)
    assert graphs.replays == 12
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 0.03 * scale
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
