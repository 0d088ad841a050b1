"""perf/ptx_census.py compiles the MLA decode kernel for sm_90 on any machine: its argument list
must follow the kernel's (a new kernel argument breaks it), and its counts must find the MMAs.
It runs in a process of its own: the kernels must be compiled, not interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_census_of_the_paged_and_page1_kernels(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "census.json"
    names = ["^h16 paged bf16$", "^h16 p1 bf16 inline$"]
    cmd = [sys.executable, str(REPO / "perf" / "ptx_census.py"), *names, "--json", str(out)]
    subprocess.run(cmd, env=env, check=True, timeout=300, capture_output=True)
    counts = json.loads(out.read_text())
    paged, page1 = counts["h16 paged bf16"], counts["h16 p1 bf16 inline"]
    for c in (paged, page1):
        assert c["mma.sync"] > 0 and c["cp.async 16B"] > 0, c
    # Page size 1 reads a slot id per row; the paged kernel one page id a tile.
    assert page1["cp.async 4B"] + page1["ld.global scalar"] > paged["ld.global scalar"], page1
