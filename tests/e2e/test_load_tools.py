"""`make sweep` and `make loadtest` against the real server, at sizes a 2-core CPU machine runs.

Both go through make, as a user runs them: `make sweep` installs perf_analyzer on first use
(`perf-deps`). The server is the module's one from conftest.py; results go to tmp_path.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.serve import REPO_ROOT, Server

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_make(target: str, variables: dict[str, object], timeout: float) -> str:
    cmd = ["make", "--no-print-directory", "-C", str(REPO_ROOT), target]
    cmd += [f"{key}={value}" for key, value in variables.items()]
    # NOTE: under `make test` the outer make's MAKEFLAGS would hand its own command-line
    # variables (and jobserver) to this make; the test states every setting itself.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, text=True
    )
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_make_sweep(server: Server, tmp_path: Path) -> None:
    settings = {"CONCURRENCY": "1:2:1", "REQUESTS": 4, "MAX_TOKENS": 8, "PROMPT_WORDS": 32}
    run_make("sweep", {"URL": server.grpc_url, "RESULTS": tmp_path, **settings}, timeout=600)

    rows = read_csv(tmp_path / "sweep.csv")
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    for r in rows:
        assert int(r["requests"]) == 4
        assert int(r["output_tokens"]) == 4 * 8
        assert float(r["output_tok_per_s"]) > 0
        for name in ("ttft", "itl", "latency"):
            assert 0 < float(r[f"{name}_p50_ms"]) <= float(r[f"{name}_p99_ms"]), (name, r)
        # Each request's first response comes before its last, so the percentiles keep the order.
        assert float(r["ttft_p50_ms"]) < float(r["latency_p50_ms"])
    png = (tmp_path / "sweep.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_make_loadtest(server: Server, tmp_path: Path) -> None:
    settings = {"USERS": 4, "SPAWN_RATE": 4, "DURATION": "20s", "MAX_TOKENS": 16}
    settings["PROMPT_WORDS"] = 32
    out = run_make("loadtest", {"URL": server.http_url, "RESULTS": tmp_path, **settings}, 300)

    rows = {(r["Type"], r["Name"]): r for r in read_csv(tmp_path / "loadtest_stats.csv")}
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0, out[-4000:]
    assert read_csv(tmp_path / "loadtest_failures.csv") == []
    streams = int(rows[("POST", "generate_stream")]["Request Count"])
    assert streams >= 4, out[-4000:]  # every user finished at least one stream
    for name in ("TTFT", "ITL", "E2E"):
        row = rows[("SSE", name)]
        assert int(row["Request Count"]) == streams, (name, row)
        assert float(row["Median Response Time"]) > 0, (name, row)
    assert float(rows[("SSE", "TTFT")]["Average Response Time"]) < float(
        rows[("SSE", "E2E")]["Average Response Time"]
    )
    html = (tmp_path / "loadtest.html").read_text()
    assert "TTFT" in html and "ITL" in html
