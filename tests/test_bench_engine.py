"""perf/bench_engine.py end to end at its tiny CPU scale: every phase runs and the JSON has the
fields the GPU run reports."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, REPO / "perf" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    not (REPO / "models/smollm2-135m-instruct/tokenizer.json").is_file(),
    reason="needs the default model's tokenizer",
)
def test_tiny_cpu_run(tmp_path: Path) -> None:
    bench = _load("bench_engine")
    out = tmp_path / "result.json"
    argv = ["--tiny", "--layers", "2", "--quick", "--device", "cpu", "--ns", "1,3"]
    argv += ["--max-tokens", "4", "--b1-tokens", "4", "--profile-ns", "2"]
    argv += ["--profile-steps", "2", "--out", str(tmp_path / "ckpt"), "--json", str(out)]
    argv += ["--overlap", "on", "--overlap-compare"]  # overlapped timing, and the serial one
    argv += ["--compile-ns", "3", "--compile-backend", "aot_eager"]  # compiled, no codegen
    argv += ["--fp8-absorb-compare", "--fp8-absorb-ns", "3"]  # FP8 w_kc / w_vc engine
    threads = torch.get_num_threads()
    try:
        assert bench.main(argv) == 0  # --tiny runs on one thread
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    assert res["checkpoint"]["layers"] == 2 and not res["checkpoint"]["reused"]
    assert res["copy_bandwidth_Bps"] > 0
    assert set(res["kv_tokens"]) == {"bf16", "fp8"}
    # On CPU the engines decode with the torch-native attention backend.
    assert res["decode_kernel"] == {"bf16": "TorchNativeBackend", "fp8": "TorchNativeBackend"}
    assert {"default_bf16", "default_fp8", "eager_bf16", "compile_native_bf16"} <= set(
        res["batch1"]
    )
    compiled = res["compile"]["native"]
    assert {1, 3} <= set(compiled["compiled_sizes"]) and compiled["engine_s"] > 0
    assert [r["n"] for r in compiled["runs"]] == [3] and compiled["runs"][0]["e2e_tok_s"] > 0
    # against the default engine of the same run, which now runs before it
    assert set(compiled["vs_graphs"]) == {"batch1", "n3_decode"}
    assert all(v > 0 for v in compiled["vs_graphs"].values())
    assert res["batch1"]["eager_bf16"]["ms_per_step_median"] > 0
    for name in ("eager_bf16", "default_bf16", "overlap_off_bf16"):
        b1 = res["batch1"][name]
        assert 0 < b1["host_ms_per_step_median"] and 0 < b1["device_ms_per_step_median"]
    assert [(r["kv"], r["n"]) for r in res["runs"]] == [
        ("bf16", 1),
        ("bf16", 3),
        ("fp8", 1),
        ("fp8", 3),
    ]
    for r in res["runs"]:
        assert r["e2e_tok_s"] > 0
        dec, pre = r["decode_full"], r["prefill"]
        assert r["decode"]["steps"] >= dec["steps"]
        assert dec["steps"] == 3 and math.isclose(dec["mean_batch"], r["n"])
        assert 0 < dec["ceiling_share"] and dec["ceiling_tok_s"] > 0
        assert pre["tokens"] == 32 * r["n"] and pre["tflop_s"] > 0
    # The compiled engine's batch-1 step is profiled too (where its time goes).
    assert set(res["profile"]) == {"bf16_b2", "compile_native_b1"}
    compiled_prof = res["profile"]["compile_native_b1"]
    assert compiled_prof["steps"] == 2 and compiled_prof["batch_sizes"] == [1]
    prof = res["profile"]["bf16_b2"]
    assert (
        prof["steps"] == 2
        and prof["all_decode"]
        and prof["batch_sizes"] == [2]
        and prof["aten_ops_per_step"] > 0
        and prof["wall_ms_per_step"] > 0
    )
    fp8 = res["fp8_absorb"]
    assert res["batch1"]["default_bf16_fp8absorb"]["ms_per_step_median"] > 0
    assert [r["n"] for r in fp8["runs"]] == [3] and fp8["runs"][0]["decode_full"]["steps"] == 3
    assert "speed-up" in "\n".join(bench.fp8_absorb_report(res))
    assert not res["skipped"]
    # A second call reuses the checkpoint.
    again = bench.write_checkpoint(tmp_path / "ckpt", 2, True, "cpu")
    assert again["reused"]


def test_decode_ceiling_of_v2_lite() -> None:
    """The figures issue 12 quotes: ~2.45B parameters read at batch 1; all 64 experts at 256."""
    bench = _load("bench_engine")
    ckpt = _load("write_v2lite_checkpoint")
    cfg = ckpt.checkpoint_config()
    shapes = ckpt.tensor_shapes(cfg)
    assert sum(math.prod(s) for _, s in shapes) == 15_706_484_224
    shape = bench.Shape(27, 2048, 16, None, 512, 128, 64, 128, 10944, 1408, 64, 6, 2, 1, 102400)
    assert abs(shape.decode_bytes(1, 0, 2, 2) / 2 / 1e9 - 2.45) < 0.01
    assert shape.expected_experts(256) > 63.9
    # 16 requests at ~640 tokens of context: the 5.9 ms step of the table.
    step_ms = shape.decode_bytes(16, 16 * 640, 2, 2) / 4.27e12 * 1e3
    assert 5.8 < step_ms < 6.1


@pytest.mark.skipif(
    not (REPO / "models/smollm2-135m-instruct/tokenizer.json").is_file(),
    reason="needs the default model's tokenizer",
)
def test_tiny_cpu_run_isolated(tmp_path: Path) -> None:
    """--isolate: each KV dtype in a child process, in --kv order, merged into one result; the
    eager engine in the first child, the compile engine in the last (its ratio against the
    first child's graphs figures)."""
    bench = _load("bench_engine")
    out = tmp_path / "result.json"
    argv = ["--tiny", "--layers", "2", "--device", "cpu", "--ns", "1", "--kv", "bf16,fp8"]
    argv += ["--max-tokens", "4", "--b1-tokens", "4", "--profile-ns", "1", "--profile-kv", "fp8"]
    argv += ["--profile-steps", "2", "--out", str(tmp_path / "ckpt"), "--json", str(out)]
    argv += ["--isolate"]
    argv += ["--compile-ns", "1", "--compile-backend", "aot_eager"]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert [c["kv"] for c in res["isolated"]] == ["bf16", "fp8"]
    assert all(c["returncode"] == 0 and c["copy_bandwidth_Bps"] > 0 for c in res["isolated"])
    assert [(r["kv"], r["n"]) for r in res["runs"]] == [("bf16", 1), ("fp8", 1)]
    assert set(res["kv_tokens"]) == {"bf16", "fp8"}
    assert {"eager_bf16", "default_bf16", "default_fp8", "compile_native_bf16"} == set(
        res["batch1"]
    )
    compiled = res["compile"]["native"]
    assert set(compiled["vs_graphs"]) == {"batch1", "n1_decode"}
    assert all(v > 0 for v in compiled["vs_graphs"].values())
    assert (tmp_path / "result.bf16.json").is_file() and (tmp_path / "result.fp8.json").is_file()
    # --profile-kv: the FP8 engine's steps are profiled, the bf16 one's not.
    assert "fp8_b1" in res["profile"] and "bf16_b1" not in res["profile"]
    assert res["profile"]["fp8_b1"]["steps"] == 2 and res["profile"]["fp8_b1"]["all_decode"]


def test_order_report_averages_each_dtype_over_its_processes() -> None:
    """--abba's summary: per N, each dtype's figures averaged over its processes (fp8, bf16,
    bf16, fp8), and FP8 against bf16 end to end; nothing without a repeated dtype."""
    bench = _load("bench_engine")

    def run(kv: str, process: int, e2e: float, prefill: float) -> dict[str, Any]:
        decode = {"ms_per_step_median": 10.0}
        return dict(
            kv=kv,
            n=128,
            process=process,
            e2e_tok_s=e2e,
            decode_full=decode,
            prefill={"tok_s": prefill},
        )

    runs = [run("fp8", 0, 90.0, 60.0), run("bf16", 1, 100.0, 70.0)]
    assert bench.order_report(runs) == []
    runs += [run("bf16", 2, 96.0, 66.0), run("fp8", 3, 104.0, 72.0)]
    lines = bench.order_report(runs)
    assert lines[0].endswith("(in the order fp8, bf16, bf16, fp8):")
    assert "bf16 e2e 98.0 tok/s" in lines[1] and "fp8 e2e 97.0 tok/s" in lines[1]
    assert "prefill 68 tok/s" in lines[1] and "prefill 66 tok/s" in lines[1]
    assert lines[1].endswith(f"fp8/bf16 e2e {97.0 / 98.0:.3f}x")
