"""perf/gluon_census.py compiles its warp-specialized Gluon pipeline for sm_90 on any machine:
the loader partition's gathers must signal their mbarrier, and QK must stay an e4m3 wgmma. It
runs in a process of its own: Gluon kernels are compiled, never interpreted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gluon_pipeline_compiles_to_a_loader_and_e4m3_wgmmas() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(REPO / "perf" / "gluon_census.py")]
    out = subprocess.run(cmd, env=env, check=True, timeout=300, capture_output=True, text=True)
    counts = {m[1]: int(m[2]) for m in re.finditer(r"^  ([\w. ]+): (\d+)", out.stdout, re.M)}
    assert counts["wgmma"] > 0 and "e4m3.e4m3" in out.stdout, out.stdout
    assert counts["cp.async 16B"] > 0 and counts["cp.async arrive"] > 0, out.stdout
    # The partitions get their own register budgets.
    assert counts["setmaxnreg"] > 0, out.stdout
