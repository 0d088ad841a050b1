"""Long reliability runs through the launcher (`make soak`; left out of `make test`).

Each starts its own `python -m engine.serve` with the default model and ends by checking that
the server is ready and its KV pool whole (nothing running, no slot held).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from client.stream_client import build_inputs, stream_grpc
from engine.serving.process import SHM_PREFIX

from .conftest import wait_for
from .launcher import Launcher, OneStream, alive, children, start_launcher
from .test_reliability import assert_healthy

pytestmark = pytest.mark.soak

# The default model's own context (8192): 2,000-token streams fit.
ENGINE = {"max_total_tokens": 16384, "max_running_requests": 8}
LONG = {"max_tokens": 2000, "temperature": 0, "ignore_eos": True}
SHORT = {"max_tokens": 8, "temperature": 0}


def serve_one(launcher: Launcher) -> None:
    assert "".join(stream_grpc(launcher.server.grpc_url, build_inputs("Hello", SHORT)))
    assert_healthy(launcher.server)


def shm_regions(launcher: Launcher) -> set[str]:
    return {s.shm_region for s in launcher.stubs() if s.shm_region}


def test_sigterm_with_long_streams(tmp_path: Path) -> None:
    """SIGTERM with 4 streams of 2,000 tokens: each ends with its final response or a clear
    error, every process is gone in under 30 s, no stub or shared memory is left, and a new
    launcher on the same ports serves."""
    launcher = start_launcher(tmp_path / "serve.log", engine=ENGINE)
    launcher.wait_ready()
    pids = [*launcher.tritonservers(), *(s.pid for s in launcher.stubs())]
    regions = shm_regions(launcher)
    streams = [
        OneStream(launcher.server.grpc_url, build_inputs(f"Story number {i}:", LONG))
        for i in range(4)
    ]
    assert all(s.wait_parts(5, timeout=120) for s in streams)
    began = time.monotonic()
    launcher.process.send_signal(signal.SIGTERM)
    for s in streams:
        s.wait_end(timeout=30)
        s.close()  # as clients do once their request ended (see test_reliability.py)
    ended = time.monotonic() - began
    code = launcher.stop(None)
    took = time.monotonic() - began
    print(
        f"SIGTERM with 4 long streams: streams ended after {ended:.1f} s, all processes gone "
        f"after {took:.1f} s"
    )
    assert code == 0, launcher.log()[-3000:]
    for s in streams:
        assert s.final or (s.error is not None and "shutting down" in s.error), s.error
    assert took < 30
    assert not [pid for pid in pids if alive(pid)]
    assert not [r for r in regions if Path("/dev/shm", r).exists()]

    again = start_launcher(tmp_path / "serve2.log", ports=ports(launcher), engine=ENGINE)
    try:
        again.wait_ready()
        serve_one(again)
    finally:
        assert again.stop() == 0


def test_killed_stub_recovers(tmp_path: Path) -> None:
    """kill -9 of the stub: in-flight clients get an error, readiness goes false, the model
    serves again within 60 s, and one SIGTERM still stops everything."""
    launcher = start_launcher(tmp_path / "serve.log", engine=ENGINE)
    try:
        launcher.wait_ready()
        (stub,) = launcher.stubs()
        (engine,) = children(stub.pid, "engine.engine_process")
        streams = [
            OneStream(launcher.server.grpc_url, build_inputs(f"Story {i}:", LONG)) for i in range(2)
        ]
        assert all(s.wait_parts(3, timeout=120) for s in streams)
        killed = time.monotonic()
        os.kill(stub.pid, signal.SIGKILL)
        assert all(s.wait_end(timeout=10) for s in streams)
        assert all(s.error is not None and not s.final for s in streams)
        noticed = time.monotonic() - killed
        assert wait_for(lambda: not launcher.server.is_ready(), timeout=10, interval=0.1)
        unready = time.monotonic() - killed
        assert wait_for(launcher.server.is_ready, timeout=60, interval=0.25), launcher.log()[-3000:]
        serve_one(launcher)
        recovered = time.monotonic() - killed
        for s in streams:
            s.close()
        print(
            f"killed stub: clients saw an error after {noticed:.1f} s, not ready after "
            f"{unready:.1f} s, serving again after {recovered:.1f} s"
        )
        assert recovered < 60
        assert "serving again" in launcher.log()
        (new_stub,) = launcher.stubs()
        assert new_stub.pid != stub.pid and not alive(stub.pid)
        assert not alive(engine)  # the engine's process went with its stub
        assert stub.shm_region and not Path("/dev/shm", stub.shm_region).exists()
        pids = [*launcher.tritonservers(), new_stub.pid]
    finally:
        code = launcher.stop(signal.SIGTERM)
    assert code == 0
    assert not [pid for pid in pids if alive(pid)]


def test_killed_engine_process_recovers(tmp_path: Path) -> None:
    """kill -9 of the engine's process (engine_process, the default): its streams end with an
    error naming it, the stub ends, and the launcher has the model serving again."""
    launcher = start_launcher(tmp_path / "serve.log", engine=ENGINE)
    try:
        launcher.wait_ready()
        (stub,) = launcher.stubs()
        (engine,) = children(stub.pid, "engine.engine_process")
        stream = OneStream(launcher.server.grpc_url, build_inputs("Story:", LONG))
        assert stream.wait_parts(3, timeout=120)
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        assert stream.wait_end(timeout=10)
        assert "engine's process exited with code -9" in (stream.error or ""), stream.error
        stream.close()
        assert wait_for(lambda: not alive(stub.pid), timeout=10, interval=0.1)
        # the dead stub's server answers ready until the launcher kills it to restart
        assert wait_for(lambda: not launcher.server.is_ready(), timeout=10, interval=0.1)
        assert wait_for(launcher.server.is_ready, timeout=60, interval=0.25), launcher.log()[-3000:]
        serve_one(launcher)
        print(f"killed engine process: serving again after {time.monotonic() - killed:.1f} s")
        assert "exited with code -9" in launcher.log() and "serving again" in launcher.log()
        pids = [*launcher.tritonservers(), *(s.pid for s in launcher.stubs())]
    finally:
        code = launcher.stop(signal.SIGTERM)
    assert code == 0
    assert not [pid for pid in pids if alive(pid)]


def test_killed_launcher_takes_the_server_with_it(tmp_path: Path) -> None:
    launcher = start_launcher(tmp_path / "serve.log", engine=ENGINE)
    launcher.wait_ready()
    pids = [*launcher.tritonservers(), *(s.pid for s in launcher.stubs())]
    regions = shm_regions(launcher)
    assert len(pids) == 2
    launcher.stop(signal.SIGKILL)
    assert wait_for(lambda: not any(alive(p) for p in pids), timeout=5), pids
    assert not [r for r in regions if Path("/dev/shm", r).exists()]
    assert all(r.startswith(SHM_PREFIX) for r in regions)
    for port in ports(launcher):  # free again
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))


def ports(launcher: Launcher) -> tuple[int, int, int]:
    srv = launcher.server
    return srv.http_port, srv.grpc_port, srv.metrics_port
