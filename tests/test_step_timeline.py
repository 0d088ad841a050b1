"""perf/step_timeline.py groups a profiled step's kernels by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
import step_timeline  # noqa: E402


def test_groups_kernels_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    timeline = [["norm", 2.0, 0.0], ["gemm", 10.0, 1.0], ["norm", 4.0, 0.5], ["gemm", 12.0, 0.5]]
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"bf16": {"batch1": {"profile": {"step_timeline": timeline}}}}))
    step_timeline.main([str(path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("== /bf16/batch1/profile")
    assert out[1] == "4 kernels, 30.0 us (durations + gaps)"
    gemm, norm = out[3].split(), out[4].split()  # largest total first
    assert gemm == ["gemm", "2", "11.00", "0.75", "23.5"]
    assert norm == ["norm", "2", "3.00", "0.25", "6.5"]


def test_no_profile_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"bf16": {}}))
    with pytest.raises(SystemExit, match="no profiled step"):
        step_timeline.main([str(path)])
