"""The launcher's supervisor (engine/serving/supervisor.py) against a fake server: a stub that
dies between the model's load and the launcher's first look at the ready server still counts."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def is_ready(self, path: str = "/v2/health/ready") -> bool:
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
