"""The serving helpers without a server: engine settings from model.json + env, and metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.config import ConfigError, EngineConfig, engine_config_dict
from engine.metrics import MetricsExporter, RequestTiming
from engine.outputs import EngineStats
from engine.serve import REPO_ROOT


HEAVY = ("torch", "transformers", "numpy", "tritonclient", "triton")


def imported_heavy(statement: str, bypass_engine_init: bool) -> list[str]:
    """The heavy packages a fresh interpreter has imported after `statement`."""
    setup = ""
    if bypass_engine_init:  # engine/__init__.py exports the engine's API and may import torch
        setup = (
            "import types; pkg = types.ModuleType('engine'); "
            f"pkg.__path__ = [{str(REPO_ROOT / 'engine')!r}]; sys.modules['engine'] = pkg; "
        )
    code = f"import sys; {setup}{statement}; print(sorted(set(sys.modules) & set({HEAVY!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout.strip().replace("'", '"')))


def test_launcher_and_serving_helpers_import_nothing_heavy() -> None:
    modules = ["engine.serve", "engine.config", "engine.serving.protocol", "engine.metrics"]
    assert imported_heavy(f"import {', '.join(modules)}", bypass_engine_init=True) == []


def test_launcher_import_is_light_once_engine_init_is() -> None:
    if imported_heavy("import engine", bypass_engine_init=False):
        pytest.skip("engine/__init__.py still imports torch eagerly")
    assert imported_heavy("import engine.serve", bypass_engine_init=False) == []


def write_json(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(values))
    return path


def test_shipped_model_json_is_a_valid_engine_config() -> None:
    path = REPO_ROOT / "model_repository" / "llm" / "1" / "model.json"
    config = EngineConfig.from_dict(engine_config_dict(path, REPO_ROOT, environ={}))
    assert config.model == str(REPO_ROOT / "models" / "smollm2-135m-instruct")
    assert config.device == "auto"


def test_env_overrides_are_typed(tmp_path: Path) -> None:
    path = write_json(tmp_path, {"model": "m", "max_total_tokens": 1024})
    env = {
        "LLM_MAX_TOTAL_TOKENS": "none",
        "LLM_MAX_RUNNING_REQUESTS": "4",
        "LLM_MEM_FRACTION": "0.5",
        "LLM_ENABLE_CUDA_GRAPH": "false",
        "LLM_DEVICE": "cpu",
        "LLM_NOT_A_FIELD": "ignored",
    }
    values = engine_config_dict(path, tmp_path, environ=env)
    assert values == {
        "model": str(tmp_path / "m"),
        "max_total_tokens": None,
        "max_running_requests": 4,
        "mem_fraction": 0.5,
        "enable_cuda_graph": False,
        "device": "cpu",
    }
    EngineConfig.from_dict(values)


def test_absolute_model_path_is_kept(tmp_path: Path) -> None:
    path = write_json(tmp_path, {})
    values = engine_config_dict(path, tmp_path, environ={"LLM_MODEL": "/data/model"})
    assert values["model"] == "/data/model"


def test_bad_env_value_names_the_variable(tmp_path: Path) -> None:
    path = write_json(tmp_path, {})
    with pytest.raises(ValueError, match="LLM_MAX_RUNNING_REQUESTS"):
        engine_config_dict(path, tmp_path, environ={"LLM_MAX_RUNNING_REQUESTS": "many"})


def test_unknown_model_json_key_is_rejected_by_name(tmp_path: Path) -> None:
    path = write_json(tmp_path, {"max_totl_tokens": 5})
    with pytest.raises(ConfigError, match="max_totl_tokens"):
        EngineConfig.from_dict(engine_config_dict(path, tmp_path, environ={}))


class FakeMetric:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.value = 0.0
        self.observed: list[float] = []

    def increment(self, v: float) -> None:
        self.value += v

    def set(self, v: float) -> None:
        self.value = v

    def observe(self, v: float) -> None:
        self.observed.append(v)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: dict[str, FakeFamily] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.metrics: list[FakeMetric] = []
        FakeFamily.made[name] = self

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> FakeMetric:
        metric = FakeMetric(labels)
        self.metrics.append(metric)
        return metric


class FakePbUtils:
    MetricFamily = FakeFamily


def stats(prompt: int, gen: int, finished: dict[str, int], running: int = 0) -> EngineStats:
    return EngineStats(running, 0, 0.25, prompt, gen, 0, prompt, finished)


def test_metrics_exporter_publishes_differences() -> None:
    snapshots = [stats(10, 5, {"length": 1}, running=1), stats(30, 9, {"length": 2, "stop": 1})]
    current = iter(snapshots)
    last = [snapshots[0]]

    def stats_fn() -> EngineStats:
        last[0] = next(current, last[0])
        return last[0]

    exporter = MetricsExporter(FakePbUtils(), {"model": "llm"}, stats_fn, interval_s=0.01)
    exporter.observe_request(RequestTiming(ttft=0.1, inter_token=[0.02, 0.03], e2e=0.2))
    time.sleep(0.1)
    exporter.close()
    made = FakeFamily.made
    assert made["llm_prompt_tokens_total"].metrics[0].value == 30
    assert made["llm_generation_tokens_total"].metrics[0].value == 9
    assert made["llm_num_requests_running"].metrics[0].value == 0
    assert made["llm_kv_cache_usage_ratio"].metrics[0].value == 0.25
    by_reason = {m.labels["reason"]: m.value for m in made["llm_request_finished_total"].metrics}
    assert by_reason == {"stop": 1, "length": 2, "abort": 0}
    assert made["llm_time_to_first_token_seconds"].metrics[0].observed == [0.1]
    assert made["llm_inter_token_latency_seconds"].metrics[0].observed == [0.02, 0.03]
