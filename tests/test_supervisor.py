"""The launcher's supervisor (engine/serving/supervisor.py) against a fake server: a stub that
dies between the model's load and the launcher's first look at the ready server still counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.serving.process import Stub
from engine.serving.supervisor import Supervisor


@dataclass
class FakeProcess:
    code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, signum: int) -> None:
        self.code = 0  # a stop: the server exits at once


@dataclass
class FakeServer:
    """Ready at once; `deaths` lists what each check_stubs() call reports (then nothing)."""

    deaths: list[list[Stub]]
    on_check: object = None
    process: FakeProcess = field(default_factory=FakeProcess)
    killed: bool = False

    def check_stubs(self) -> list[Stub]:
        if callable(self.on_check):
            self.on_check()
        return self.deaths.pop(0) if self.deaths else []

    asked: list[str] = field(default_factory=list)  # the readiness paths polled

    def is_ready(self, path: str = "/v2/health/ready") -> bool:
        self.asked.append(path)
        return True

    def kill(self) -> None:
        self.killed = True
        self.process.code = -9

    def signal_stubs(self, signum: int) -> None:
        pass


def _run(first: FakeServer) -> tuple[list[str], FakeServer]:
    logs: list[str] = []
    supervisor: Supervisor

    def stop() -> None:  # the restarted server's first check ends the run
        supervisor.signals += 1

    second = FakeServer(deaths=[], on_check=stop)
    servers = [first, second]
    supervisor = Supervisor(lambda: servers.pop(0), 0.0, 5.0, log=logs.append)  # type: ignore[arg-type,return-value]
    assert supervisor.run() == 0
    return logs, second


def test_a_stub_dead_before_the_first_look_is_restarted() -> None:
    # The first check_stubs() call (while waiting for ready) sees the stub die.
    first = FakeServer(deaths=[[Stub(11, "llm", None)]])
    logs, second = _run(first)
    assert first.killed
    assert any("stub of llm (pid 11) died; restarting" in line for line in logs), logs


def test_a_healthy_stub_is_left_alone() -> None:
    logs: list[str] = []
    supervisor: Supervisor
    checks = 0

    def count() -> None:
        nonlocal checks
        checks += 1
        if checks >= 4:
            supervisor.signals += 1

    server = FakeServer(deaths=[], on_check=count)
    supervisor = Supervisor(lambda: server, 0.0, 5.0, log=logs.append)  # type: ignore[arg-type,return-value]
    assert supervisor.run() == 0
    assert not any("restarting" in line for line in logs), logs


def test_ready_means_the_model_is_ready() -> None:
    """The server answers /v2/health/ready with no model loaded (an empty repository, or
    --model-control-mode=explicit): the launcher waits for the llm model itself."""
    logs: list[str] = []
    supervisor: Supervisor

    def stop() -> None:
        supervisor.signals += 1

    server = FakeServer(deaths=[])
    supervisor = Supervisor(
        lambda: server,
        0.0,
        5.0,
        on_ready=lambda srv: stop(),
        log=logs.append,  # type: ignore[arg-type,return-value]
    )
    assert supervisor.run() == 0
    assert server.asked and set(server.asked) == {"/v2/models/llm/ready"}, server.asked


def test_the_launcher_refuses_a_repository_without_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import types

    import engine.serving.cli as cli

    monkeypatch.setattr(cli, "find_tritonserver", lambda: types.SimpleNamespace(binary="ts"))
    assert cli.main(["--model-repository", str(tmp_path)]) == 2
    assert "no llm/config.pbtxt" in capsys.readouterr().err
