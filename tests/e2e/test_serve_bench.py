"""perf/serve_bench.py against the session's real server, at tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from engine.serve import REPO_ROOT, Server

_spec = importlib.util.spec_from_file_location("serve_bench", REPO_ROOT / "perf" / "serve_bench.py")
assert _spec is not None and _spec.loader is not None
serve_bench = importlib.util.module_from_spec(_spec)
sys.modules["serve_bench"] = serve_bench  # dataclasses look their module up by name
_spec.loader.exec_module(serve_bench)


def test_serve_bench_server_target(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "server.json"
    rc = serve_bench.main(
        [
            "--target=server",
            f"--url={server.grpc_url}",
            "--concurrency=1,2",
            "--prompt-tokens=12",
            "--max-tokens=4",
            "--requests-per-worker=1",
            f"--metrics-url={server.metrics_url}",
            f"--out={out}",
        ]
    )
    assert rc == 0
    rows = check_rows(out)
    for row in rows:  # the model's own TTFT, from the server's histogram, within the client's
        assert 0 < row["stub_ttft_mean_ms"] <= row["ttft_mean_ms"]
        # and the engine's stages (its RequestMetrics) within the model's TTFT
        assert 0 <= row["engine_queue_mean_ms"]
        assert 0 < row["engine_prefill_mean_ms"]
        assert (
            row["engine_queue_mean_ms"] + row["engine_prefill_mean_ms"] <= row["stub_ttft_mean_ms"]
        )


def test_serve_bench_engine_process_target(tmp_path: Path) -> None:
    """The same requests through EngineProcess (the engine in a child process, no Triton)."""
    out = tmp_path / "engine_process.json"
    rc = serve_bench.main(
        [
            "--target=engine_process",
            "--concurrency=1,2",
            "--prompt-tokens=12",
            "--max-tokens=4",
            "--requests-per-worker=1",
            f"--out={out}",
        ]
    )
    assert rc == 0
    for row in check_rows(out):  # the engine's stages, from each final delta's RequestMetrics
        assert 0 <= row["engine_queue_mean_ms"]
        assert 0 < row["engine_prefill_mean_ms"] <= row["ttft_mean_ms"]
        assert len(row["engine_prefill_ms"]) == row["requests"]


def check_rows(out: Path) -> list[dict]:
    res = json.loads(out.read_text())
    assert [r["concurrency"] for r in res["rows"]] == [1, 2]
    for row in res["rows"]:
        assert row["errors"] == 0
        assert row["output_tokens"] == row["concurrency"] * 4
        assert row["output_tok_per_s"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert row["itl_p50_ms"] > 0
        assert len(row["ttft_ms"]) == row["requests"]  # every request's TTFT
        assert min(row["ttft_ms"]) <= row["ttft_p50_ms"] <= max(row["ttft_ms"])
    rows: list[dict] = res["rows"]
    return rows


def test_prompt_has_the_asked_token_count() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(serve_bench.DEFAULT_TOKENIZER))
    words = serve_bench.single_token_words(tok)
    for seed in range(3):
        text = serve_bench.make_prompt(tok, words, 64, seed)
        assert len(tok.encode(text, add_special_tokens=False)) == 64


def test_every_prompt_of_a_run_is_new() -> None:
    """The warm-up's and every level's prompts differ (their seeds once collided, -k and k,
    and the first requests of each level hit the prefix cache)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(serve_bench.DEFAULT_TOKENIZER))
    words = serve_bench.single_token_words(tok)
    warm, levels = serve_bench.prompt_seeds([1, 4, 2], per_worker=2, min_requests=3, seed=0)
    assert [len(s) for s in levels] == [3, 8, 4]
    seeds = warm + [k for level in levels for k in level]
    prompts = {serve_bench.make_prompt(tok, words, 16, k)[:60] for k in seeds}
    assert len(prompts) == len(seeds)


def test_level_totals_wait_for_every_histogram(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model publishes a request's TTFT before its engine stages: a page read in between
    (a loaded CI machine once did) must not end the level without them."""
    ttft, queue, prefill = serve_bench.SERVER_MEANS.values()
    before = {ttft: (0.0, 0), queue: (0.0, 0), prefill: (0.0, 0)}
    pages = iter(
        [
            {ttft: (0.5, 2), queue: (0.0, 0), prefill: (0.0, 0)},
            {ttft: (0.5, 2), queue: (0.01, 2), prefill: (0.0, 1)},
            {ttft: (0.5, 2), queue: (0.01, 2), prefill: (0.3, 2)},
        ]
    )
    monkeypatch.setattr(serve_bench, "histogram_totals", lambda url: next(pages))
    after = serve_bench.settled_totals("http://x/metrics", before, 2)
    assert after[prefill] == (0.3, 2)
    means = serve_bench.level_means(before, after)
    assert set(means) == {"stub_ttft_mean_ms", "engine_queue_mean_ms", "engine_prefill_mean_ms"}
