"""One tritonserver process: start it, wait until it is ready, stop it, find its backend stubs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.serving.install import STUB_NAME, TritonInstall, find_tritonserver, server_env


@dataclass
class Server:
    """A running tritonserver process and its endpoints."""

    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    metrics_port: int
    host: str = "localhost"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def is_ready(self) -> bool:
        url = f"http://{self.http_url}/v2/health/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        """Block until the server answers ready; raise if it exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"tritonserver exited with code {code} before it was ready")
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver was not ready after {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; also kill Python backend stubs left behind."""
        stubs = child_stubs(self.process.pid)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        kill_stubs(stubs)
        return self.process.returncode


def start_server(
    model_repository: Path,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    extra_args: Sequence[str] = (),
    install: TritonInstall | None = None,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    new_session: bool = False,
) -> Server:
    """Start tritonserver (does not wait for readiness; call `Server.wait_ready`)."""
    install = install or find_tritonserver()
    if install is None:
        raise FileNotFoundError(
            "tritonserver not found: not on PATH and the nvidia-pytriton package is not installed"
        )
    cmd = [
        str(install.binary),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
    ]
    if install.backend_dir is not None:
        cmd.append(f"--backend-directory={install.backend_dir}")
    cmd.extend(extra_args)
    process = subprocess.Popen(
        cmd,
        env=server_env(install, env),
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        start_new_session=new_session,
    )
    return Server(process, http_port, grpc_port, metrics_port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_stubs(pid: int) -> list[int]:
    """Pids of the Python backend stubs whose parent is `pid` (read from /proc)."""
    stubs = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and STUB_NAME.encode() in cmdline:
            stubs.append(int(entry.name))
    return stubs


def kill_stubs(pids: Sequence[int]) -> None:
    # NOTE: a stub whose server crashed can linger and ignore SIGTERM; only SIGKILL ends it.
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
