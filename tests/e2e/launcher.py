"""Helpers for tests that run the launcher (`python -m engine.serve`) as a user does, and for
clients that watch how a request ends."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tritonclient.grpc as grpcclient

from client.stream_client import grpc_inputs
from engine.serve import REPO_ROOT, Server, free_port
from engine.serving.process import Stub, find_stubs

from .conftest import MODEL_DIR, READY_TIMEOUT_S


@dataclass
class Launcher:
    """A running `python -m engine.serve` and the endpoints of the server it keeps."""

    process: subprocess.Popen[bytes]
    server: Server  # for its URLs and readiness; its `process` is the launcher's
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Seconds until the server answered ready; fail with the log if it never did."""
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            assert self.process.poll() is None, f"launcher exited early:\n{self.log()[-4000:]}"
            if self.server.is_ready():
                return time.monotonic() - began
            time.sleep(0.25)
        raise AssertionError(f"not ready after {timeout} s:\n{self.log()[-4000:]}")

    def tritonservers(self) -> list[int]:
        return children(self.process.pid, "tritonserver")

    def stubs(self) -> list[Stub]:
        return [stub for pid in self.tritonservers() for stub in find_stubs(pid)]

    def stop(self, signum: int | None = signal.SIGTERM, timeout: float = 40.0) -> int:
        """Send `signum` (None: none, it was sent already) and wait for the launcher to exit."""
        if signum is not None and self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.process.pid)
            raise


def start_launcher(
    log_path: Path,
    ports: tuple[int, int, int] | None = None,
    args: Sequence[str] = (),
    engine: dict[str, Any] | None = None,
) -> Launcher:
    """Start the launcher on free (or the given) ports with the default model."""
    http, grpc, metrics = ports or (free_port(), free_port(), free_port())
    env = dict(os.environ)
    env["LLM_MODEL"] = str(MODEL_DIR)
    for key, value in (engine or {}).items():
        env[f"LLM_{key.upper()}"] = str(value)
    cmd = [sys.executable, "-m", "engine.serve", "--http-port", str(http)]
    cmd += ["--grpc-port", str(grpc), "--metrics-port", str(metrics), *args]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    return Launcher(process, Server(process, http, grpc, metrics), log_path)


def children(pid: int, name: str) -> list[int]:
    """Pids of the live processes whose parent is `pid` and whose command line holds `name`."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z" and name.encode() in cmdline:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_tree(pid: int) -> None:
    for child in children(pid, "tritonserver"):
        for stub in find_stubs(child):
            os.kill(stub.pid, signal.SIGKILL)
        os.kill(child, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)


class OneStream:
    """One request on a gRPC stream of its own: its text deltas and how it ended."""

    def __init__(self, url: str, fields: dict[str, Any]) -> None:
        self.parts: list[str] = []
        self.error: str | None = None
        self.final = False
        self.events: queue.Queue[str] = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_result)
        self.client.async_stream_infer(
            "llm", grpc_inputs(fields), request_id="one", enable_empty_final_response=True
        )

    def _on_result(self, result: Any, error: Any) -> None:
        if error is not None:
            self.error = str(error)
            self.events.put("error")
            return
        text = result.as_numpy("text_output")
        if text is not None and text.size:
            self.parts.append(text.reshape(-1)[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            self.final = True
        self.events.put("response")

    @property
    def ended(self) -> bool:
        return self.final or self.error is not None

    def wait_parts(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.parts) < n and not self.ended and time.monotonic() < deadline:
            try:
                self.events.get(timeout=0.2)
            except queue.Empty:
                pass
        return len(self.parts) >= n

    def wait_end(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.ended and time.monotonic() < deadline:
            try:
                self.events.get(timeout=0.2)
            except queue.Empty:
                pass
        return self.ended

    def close(self) -> None:
        try:
            self.client.stop_stream()
            self.client.close()
        except Exception:  # the server may be gone
            pass
