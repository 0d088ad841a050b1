"""One tritonserver process: start it, wait until it is ready, stop or kill it with its stubs.

The server is started through a tiny exec helper that sets the parent-death signal (SIGKILL), so
it never outlives the process that started it, even one killed by SIGKILL. Its Python-backend
stubs end themselves once their server is gone (engine/serving/lifecycle.py); `kill()` also ends
them and removes their shared-memory regions, which a killed server leaves in /dev/shm.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.serving.install import (
    STUB_NAME,
    TritonInstall,
    find_tritonserver,
    has_nvidia_gpu,
    server_env,
)

SHM_PREFIX = "triton_python_backend_shm_region"
# Runs in the child: PR_SET_PDEATHSIG (1) = SIGKILL, then exec the server. It stays set across
# exec. NOTE: the signal comes when the *thread* that started the child ends, so servers are
# started from the main thread (the launcher's supervisor and pytest both do).
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"  # the parent is already gone
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
# Flags that keep a CPU-only machine's log free of CUDA/NVML/DCGM errors (added unless given).
CPU_FLAGS = ("--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false")


@dataclass
class Stub:
    """A Python-backend stub process of the server: one per model instance."""

    pid: int
    model: str  # the model's name (the folder of its model.py in the repository)
    shm_region: str | None  # its shared-memory region under /dev/shm


@dataclass
class Server:
    """A running tritonserver process, its endpoints and the stubs it started."""

    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    metrics_port: int
    host: str = "localhost"
    stubs: dict[int, Stub] = field(default_factory=dict)  # live stubs (see `check_stubs`)
    shm_regions: set[str] = field(default_factory=set)  # of every stub seen, dead ones too

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def is_ready(self, path: str = "/v2/health/ready") -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:  # refused, reset, or an HTTP error status (not ready)
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

    def check_stubs(self) -> list[Stub]:
        """Record the server's current stubs; return those that died while their model is still
        reported ready (a stub that exits because its model was unloaded is simply forgotten)."""
        current = {s.pid: s for s in find_stubs(self.process.pid)}
        dead = []
        for pid, stub in list(self.stubs.items()):
            if pid in current:
                continue
            del self.stubs[pid]
            if self.process.poll() is None and self.is_ready(f"/v2/models/{stub.model}/ready"):
                dead.append(stub)
        self.stubs.update(current)
        self.shm_regions.update(s.shm_region for s in current.values() if s.shm_region)
        return dead

    def signal_stubs(self, signum: int) -> None:
        self.check_stubs()
        for stub in self.stubs.values():
            _signal_stub(stub.pid, signum)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (stubs too: the model drains), then `kill()` after `timeout`."""
        self.signal_stubs(signal.SIGTERM)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL the server if it still runs, then every stub it started; free their shm."""
        self.check_stubs()
        if self.process.poll() is None:
            self.process.kill()
        code = self.process.wait()
        for stub in self.stubs.values():
            _signal_stub(stub.pid, signal.SIGKILL)
        for region in self.shm_regions:
            Path("/dev/shm", region).unlink(missing_ok=True)
        return code


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
    port_wait_s: float = 0.0,
) -> Server:
    """Start tritonserver (does not wait for readiness; call `Server.wait_ready`).

    Raises OSError when one of the ports is still taken after `port_wait_s` (a server already
    running there would otherwise answer the readiness checks of this one).
    """
    install = install or find_tritonserver()
    if install is None:
        raise FileNotFoundError(
            "tritonserver not found: not on PATH and the nvidia-pytriton package is not installed"
        )
    for port in (http_port, grpc_port, metrics_port):
        wait_port_free(port, port_wait_s)
    cmd = [
        str(install.binary),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
    ]
    if install.backend_dir is not None:
        cmd.append(f"--backend-directory={install.backend_dir}")
    if not has_nvidia_gpu():
        given = {a.split("=", 1)[0] for a in extra_args}
        cmd.extend(f for f in CPU_FLAGS if f.split("=", 1)[0] not in given)
    cmd.extend(extra_args)
    helper = [sys.executable, "-I", "-S", "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid())]
    process = subprocess.Popen(
        [*helper, *cmd],
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


def wait_port_free(port: int, timeout: float = 0.0) -> None:
    """Return once `port` can be bound; raise OSError if it is still taken after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
                return
            except OSError as e:
                if e.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                    raise OSError(e.errno, f"port {port} is already in use") from None
        time.sleep(0.2)


def find_stubs(pid: int) -> list[Stub]:
    """The live Python-backend stubs whose parent is `pid` (read from /proc)."""
    stubs = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) != pid or state == "Z" or not argv[0].endswith(STUB_NAME):
            continue
        # argv: stub, <repository>/<model>/<version>/model.py, shm region, ...
        model = Path(argv[1]).parent.parent.name if len(argv) > 1 else ""
        region = next((a for a in argv if a.startswith(SHM_PREFIX)), None)
        stubs.append(Stub(int(entry.name), model, region))
    return stubs


def _signal_stub(pid: int, signum: int) -> None:
    """Signal `pid` if it is still a stub (a pid can be reused once its process is gone)."""
    try:
        if STUB_NAME.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signum)
    except (OSError, ProcessLookupError):
        pass
