"""One real tritonserver for the end-to-end tests, on free ports, with the real model repository.

The server gets small engine limits through `LLM_<FIELD>` variables (the same ones users set),
and the offline `LLM` in this process gets the same limits, so greedy outputs can be compared.
One server serves the whole session (every module that asks for `server`).

Tests marked `soak` (long: they start and stop their own servers) run only when selected:
`make soak` (`pytest -m soak tests/e2e`); `make test` leaves them out.
"""

from __future__ import annotations

import os
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.serve import REPO_ROOT, Server, find_tritonserver, free_port, start_server

if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))  # `client/` is a folder of the checkout, not installed

MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
# Small limits keep the server light on a 2-core CI machine and make "too long" cheap to hit.
ENGINE_OVERRIDES: dict[str, Any] = {
    "max_context_len": 512,
    "max_total_tokens": 8192,
    "max_tokens_cap": 1000,
}
READY_TIMEOUT_S = 300


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "soak: long end-to-end run (make soak); left out unless -m selects it"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "soak" in (config.getoption("markexpr", "") or ""):
        return
    soak = [item for item in items if "soak" in item.keywords]
    if soak:
        config.hook.pytest_deselected(items=soak)
        items[:] = [item for item in items if "soak" not in item.keywords]


@pytest.fixture(scope="session")
def server(started_server: tuple[Server, Path], offline: Any) -> Server:
    """The server, ready. The offline reference loads while the server starts."""
    srv, log_path = started_server
    try:
        srv.wait_ready(READY_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as e:
        tail = log_path.read_text(errors="replace")[-4000:]
        pytest.fail(f"{e}\n--- server log (tail) ---\n{tail}")
    return srv


@pytest.fixture(scope="session")
def started_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    install = find_tritonserver()
    if install is None:
        pytest.skip("tritonserver not found: not on PATH and nvidia-pytriton is not installed")
    if not (MODEL_DIR / "config.json").is_file():
        pytest.fail(f"default model missing at {MODEL_DIR}; run `make model`")
    repository = Path(os.environ.get("E2E_MODEL_REPOSITORY", REPO_ROOT / "model_repository"))
    env = dict(os.environ)
    env["LLM_MODEL"] = str(MODEL_DIR)
    for key, value in ENGINE_OVERRIDES.items():
        env[f"LLM_{key.upper()}"] = str(value)
    log_path = tmp_path_factory.mktemp("triton") / "server.log"
    with open(log_path, "wb") as log:
        srv = start_server(
            repository,
            http_port=free_port(),
            grpc_port=free_port(),
            metrics_port=free_port(),
            install=install,
            env=env,
            stdout=log,
        )
    yield srv, log_path
    srv.stop(timeout=30)  # SIGTERM (the model drains), then SIGKILL of what is left


@pytest.fixture(scope="session")
def offline() -> Any:
    """The same engine, offline, with the server's limits: the reference for greedy text."""
    from engine import LLM

    return LLM(model=str(MODEL_DIR), **ENGINE_OVERRIDES)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(srv: Server) -> dict[str, float]:
    """Prometheus samples keyed by `name` (summed over labels) and by `name{labels}`."""
    with urllib.request.urlopen(srv.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        samples[name] = samples.get(name, 0.0) + value
        samples[name + labels] = value
    return samples


def finished(samples: dict[str, float], reason: str) -> float:
    """`llm_request_finished_total` for one reason, summed over the model's instances."""
    prefix, label = "llm_request_finished_total{", f'reason="{reason}"'
    return sum(v for k, v in samples.items() if k.startswith(prefix) and label in k)


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
