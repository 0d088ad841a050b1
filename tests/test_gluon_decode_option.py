"""EngineConfig.mla_decode_kernel: MLA decode through the warp-specialized Gluon kernels
(engine/kernels/mla_decode_gluon.py over an FP8 cache, mla_decode_gluon_wide.py over a 16-bit
one at 64+ heads) or the Triton one. "gluon" where it cannot
run is refused at start with the reason; "auto" (the default) takes the Gluon kernel where it
serves and the Triton one elsewhere; on a Hopper GPU the engine's logits match the Triton
kernel's, eager and replayed from CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from test_cuda_graph import _teacher_forced_logits, v2lite_two_layers  # noqa: F401 (fixture)

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.executor.model_runner import ModelRunner

GLUON = dict(kv_cache_dtype="fp8_e4m3", mla_decode_kernel="gluon")
CPU = dict(device="cpu", dtype="float32", max_total_tokens=256, max_context_len=64)
HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (sm_90)",
)


def test_option_is_validated() -> None:
    with pytest.raises(ConfigError, match="mla_decode_kernel must be one of"):
        EngineConfig(mla_decode_kernel="flashmla")
    # Whether it can run (the cache, the heads, the GPU) is checked at start, with the model.
    assert EngineConfig(mla_decode_kernel="gluon").mla_decode_kernel == "gluon"
    assert EngineConfig(**GLUON).mla_decode_kernel == "gluon"  # type: ignore[arg-type]
    assert EngineConfig().mla_decode_kernel == "auto"


def test_auto_takes_gluon_where_it_serves(tiny_mla, monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto" on a CPU: the Triton kernel, and the engine runs; where the Gluon kernel would
    fit (a stand-in for a Hopper GPU), the Triton backend takes it over an FP8 or a bf16 pool,
    not over a float32 one, and the torch-native one does not; a bf16 pool at 64+ heads of a
    512 latent needs the kernel of 64 heads a program to fit."""
    from engine.kernels import mla_decode_gluon
    from engine.layers.attention.registry import make_attention_backend
    from engine.layers.attention.triton_backend import TritonBackend

    fp8 = dict(model=tiny_mla("v2"), **CPU, kv_cache_dtype="fp8_e4m3")
    llm = LLM(**fp8)  # type: ignore[arg-type]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].token_ids) == 3
    pool, cpu = llm.core.runner.kv_pool, torch.device("cpu")
    triton = make_attention_backend("triton", pool, cpu, "auto")
    assert isinstance(triton, TritonBackend) and not triton.gluon_decode
    monkeypatch.setattr(mla_decode_gluon, "fits", lambda *args: True)
    triton = make_attention_backend("triton", pool, cpu, "auto")
    assert isinstance(triton, TritonBackend) and triton.gluon_decode
    assert not make_attention_backend("triton", pool, cpu, "triton").gluon_decode  # type: ignore[attr-defined]
    assert not isinstance(make_attention_backend("torch_native", pool, cpu, "auto"), TritonBackend)
    # A float32 pool (allowed on a GPU too): no Gluon kernel takes it (their wgmmas are 8 or
    # 16 bits), so "auto" keeps the Triton kernel and "gluon" is refused naming the dtype.
    fp32 = ModelRunner(EngineConfig(model=tiny_mla("v2"), **CPU))  # type: ignore[arg-type]
    assert not make_attention_backend("triton", fp32.kv_pool, cpu, "auto").gluon_decode  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="needs a bf16, fp16 or fp8 cache, not torch.float32"):
        make_attention_backend("triton", fp32.kv_pool, cpu, "gluon")
    bf16 = ModelRunner(EngineConfig(model=tiny_mla("v2"), **{**CPU, "dtype": "bfloat16"}))  # type: ignore[arg-type]
    assert bf16.kv_pool.store_dtype == torch.bfloat16
    # A bf16 pool at 16 heads: the 16-head kernel over the 16-bit ring, where it fits.
    assert make_attention_backend("triton", bf16.kv_pool, cpu, "auto").gluon_decode  # type: ignore[attr-defined]
    monkeypatch.setattr(mla_decode_gluon, "fits", lambda *args: False)
    assert not make_attention_backend("triton", bf16.kv_pool, cpu, "auto").gluon_decode  # type: ignore[attr-defined]
    # At 64+ heads of a 512 latent (a stand-in for the tiny model's): the kernel of 64 heads a
    # program, where it fits.
    from engine.kernels import mla_decode_gluon_wide

    monkeypatch.setattr(mla_decode_gluon_wide, "serves_shape", lambda heads, *_: heads >= 64)
    for wide_fits in (False, True):
        monkeypatch.setattr(mla_decode_gluon_wide, "fits", lambda *args, f=wide_fits: f)
        wide = make_attention_backend("triton", bf16.kv_pool, cpu, "auto", num_heads=128)
        assert wide.gluon_decode == wide_fits  # type: ignore[attr-defined]


def test_refused_where_it_cannot_run(tiny_llama: str, tiny_mla) -> None:
    """Not an MLA model; an MLA model on a CPU (Gluon compiles for Hopper GPUs only)."""
    with pytest.raises(ConfigError, match="applies to MLA models"):
        ModelRunner(EngineConfig(model=tiny_llama, **CPU, **GLUON))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"needs a Hopper GPU \(sm_90; this is cpu\)"):
        ModelRunner(EngineConfig(model=tiny_mla("v2"), **CPU, **GLUON))  # type: ignore[arg-type]
    # A bf16 cache (the 16-head kernel over the 16-bit ring, at the tiny model's heads).
    bf16 = EngineConfig(model=tiny_mla("v2"), **CPU, mla_decode_kernel="gluon")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"needs a Hopper GPU \(sm_90; this is cpu\), a latent"):
        ModelRunner(bf16)


def test_refused_outside_the_triton_backend(tiny_mla, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel would fit (a stand-in for a Hopper GPU), the torch-native backend, which
    never calls it, is refused rather than silently ignoring the setting."""
    from engine.kernels import mla_decode_gluon

    monkeypatch.setattr(mla_decode_gluon, "fits", lambda *args: True)
    cfg = EngineConfig(model=tiny_mla("v2"), **CPU, **GLUON)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="runs in the Triton attention backend, not"):
        ModelRunner(cfg)


@pytest.mark.cuda
@HOPPER
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "auto"])
def test_v2lite_gluon_decode_matches_triton(
    v2lite_two_layers: str,  # noqa: F811
    kv_cache_dtype: str,
) -> None:
    """DeepSeek-V2-Lite's shape (16 heads), an FP8 or a bf16 cache, teacher-forced: the Gluon
    kernel's decode logits against the Triton kernel's (for FP8 the same two-term q, the same
    cache), eager and from graphs."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (7, 40, 130, 300, 515)]
    forced = [[rng.randrange(100, 40000) for _ in range(12)] for _ in prompts]
    common = dict(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_total_tokens=8192)
    common.update(max_running_requests=8)
    llm = LLM(
        v2lite_two_layers, enable_cuda_graph=False, mla_decode_kernel="triton", **common,  # type: ignore[arg-type]
    )  # fmt: skip
    triton_logits = _teacher_forced_logits(llm, prompts, forced)
    del llm
    # Asked for by name, eager; the engine's default ("auto") from CUDA graphs.
    for graphs, kernel in ((False, "gluon"), (True, "auto")):
        llm = LLM(
            v2lite_two_layers, enable_cuda_graph=graphs, cuda_graph_max_bs=8,
            mla_decode_kernel=kernel, **common,  # type: ignore[arg-type]
        )  # fmt: skip
        assert llm.core.runner.attn_backend.gluon_decode  # type: ignore[attr-defined]
        got = _teacher_forced_logits(llm, prompts, forced)
        del llm
        scale = triton_logits.abs().max().item()
        assert (got - triton_logits).abs().max().item() <= 0.03 * scale
        assert (got.argmax(-1) == triton_logits.argmax(-1)).float().mean().item() >= 0.9


@pytest.fixture(scope="module")
def heads128_two_layers(tiny_mla) -> str:
    """DeepSeek-V2's attention (128 heads, kv_lora_rank 512, RoPE 64) in 2 dense layers of a
    small hidden size, random bf16 weights."""
    shape = dict(hidden_size=1024, heads=128, kv_lora_rank=512, qk_nope_head_dim=128)
    shape.update(qk_rope_head_dim=64, v_head_dim=128, layers=2, first_k_dense_replace=2)
    return str(tiny_mla("v2", weight_scale=0.02, save_dtype=torch.bfloat16, **shape))


@pytest.mark.cuda
@HOPPER
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_128_heads_gluon_decode_matches_triton(
    heads128_two_layers: str, kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """128 heads, bf16 or FP8 cache, teacher-forced: the decode logits of the Gluon kernel of 64
    heads a program (the default, "auto"; over FP8 from 8 requests, q as one e4m3 term) against
    the Triton kernel's, eager and from graphs."""
    import random

    from engine.kernels import mla_decode_gluon_wide

    launches = []
    launch_stage1 = mla_decode_gluon_wide.launch_stage1
    monkeypatch.setattr(
        mla_decode_gluon_wide,
        "launch_stage1",
        lambda *a, **k: launches.append(a[0].shape[0]) or launch_stage1(*a, **k),
    )
    rng = random.Random(1)
    lens = (5, 64, 200, 700, 9, 130, 400, 1000)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lens]
    forced = [[rng.randrange(100, 40000) for _ in range(10)] for _ in prompts]
    common = dict(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_total_tokens=16384)
    common.update(max_running_requests=8)
    llm = LLM(
        heads128_two_layers, enable_cuda_graph=False, mla_decode_kernel="triton", **common,  # type: ignore[arg-type]
    )  # fmt: skip
    triton_logits = _teacher_forced_logits(llm, prompts, forced)
    del llm
    assert not launches
    for graphs in (False, True):
        llm = LLM(
            heads128_two_layers, enable_cuda_graph=graphs, cuda_graph_max_bs=8, **common,  # type: ignore[arg-type]
        )  # fmt: skip
        assert llm.core.runner.attn_backend.gluon_decode  # type: ignore[attr-defined]
        got = _teacher_forced_logits(llm, prompts, forced)
        del llm
        assert 8 in launches  # the wide kernel ran the batch of 8 (eager, or when captured)
        launches.clear()
        scale = triton_logits.abs().max().item()
        tol = 0.02 if kv_cache_dtype == "auto" else 0.03  # one e4m3 term for q against exact q
        assert (got - triton_logits).abs().max().item() <= tol * scale
        assert (got.argmax(-1) == triton_logits.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.cuda
@HOPPER
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_128_heads_pdl_launches_match_plain_launches(
    heads128_two_layers: str, kv_cache_dtype: str
) -> None:
    """The Gluon kernel of 64 heads a program under programmatic dependent launch: each of its
    partitions waits for the previous launch before it reads q or the cache or writes, so its
    logits equal those of plain launches bitwise (8 requests, from CUDA graphs)."""
    import random

    from engine.kernels import launch as launch_mod

    if not launch_mod.pdl_active(0):
        pytest.skip("no PDL on this GPU or Triton")
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(5, 900))] for _ in range(8)]
    forced = [[rng.randrange(100, 40000) for _ in range(8)] for _ in prompts]
    common = dict(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_total_tokens=16384)
    common.update(max_running_requests=8, enable_cuda_graph=True, cuda_graph_max_bs=8)
    wanted = launch_mod._PDL_WANTED
    got = {}
    for pdl in (False, True):
        launch_mod.set_pdl(pdl)
        try:
            llm = LLM(heads128_two_layers, **common)  # type: ignore[arg-type]
            assert llm.core.runner.attn_backend.gluon_decode  # type: ignore[attr-defined]
            got[pdl] = _teacher_forced_logits(llm, prompts, forced)
            del llm
        finally:
            launch_mod.set_pdl(wanted)
    assert torch.equal(got[True], got[False]), (got[True] - got[False]).abs().max()
