"""perf/cpu_sampler.py's CPU-list helpers (what gpu_serve.sh pins the engine_process_pinned
target with)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[1] / "perf" / "cpu_sampler.py"
_spec = importlib.util.spec_from_file_location("cpu_sampler", _path)
assert _spec is not None and _spec.loader is not None
cpu_sampler = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_sampler)


def test_parse_cpulist() -> None:
    assert cpu_sampler.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_sampler.parse_cpulist("5") == {5}
    assert cpu_sampler.parse_cpulist("") == set()


def test_gpu_local_cpus_is_the_first_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [("0000:3b:00.0", "1", "8-15"), ("0000:af:00.0", "0", "0-7")]
    monkeypatch.setattr(cpu_sampler, "nvidia_gpus", lambda: gpus)
    assert cpu_sampler.gpu_local_cpus() == "8-15"
    assert "gpu 0000:3b:00.0 numa_node 1 local cpus 8-15" in cpu_sampler.topology()
    monkeypatch.setattr(cpu_sampler, "nvidia_gpus", lambda: [])
    assert cpu_sampler.gpu_local_cpus() is None
