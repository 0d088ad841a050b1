"""Keeps one tritonserver serving until it is asked to stop, and never waits without a limit.

- Stop (first SIGTERM/SIGINT): SIGTERM to the stubs, whose model drains (new requests refused
  with "server shutting down", in-flight ones ended after `grace_s`), and to tritonserver, which
  then unloads the model and exits on its own. Whatever still runs `grace_s + KILL_MARGIN_S`
  after the signal is killed (server and stubs). A second signal kills at once.
- A stub that dies (kill -9, the OOM killer) while its model is reported ready, or a server
  that exits by itself: Triton 2.51's Python backend neither fails the dead stub's decoupled
  requests nor restarts it (its source says "TODO: Implement restart on decoupled"), and the
  server keeps answering ready. So the server is killed with its stubs, which fails every
  in-flight request with a connection error, and started again on the same ports; readiness is
  false until the model has loaded again. The time taken is printed. After MAX_FAILURES
  failures within FAILURE_WINDOW_S the launcher gives up (exit 1).

Runs in the main thread: a server started from another thread would get its parent-death
signal when that thread ended (see process.py).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from engine.serving.process import Server, Stub

KILL_MARGIN_S = 5.0  # after the grace period, for the model to unload and the server to exit
POLL_S = 0.25
MODEL = "llm"  # the served model: its folder in the repository and its name on the server
# Ready means the model is: the server alone answers ready with no model loaded (an empty
# repository, or one loaded on request with --model-control-mode=explicit).
MODEL_READY_PATH = f"/v2/models/{MODEL}/ready"
# A server that keeps failing is not restarted forever: the launcher exits 1 instead, for
# whatever runs it (a container runtime) to act.
MAX_FAILURES, FAILURE_WINDOW_S = 3, 600.0


class Supervisor:
    def __init__(
        self,
        start: Callable[[], Server],
        grace_s: float,
        ready_timeout: float,
        on_ready: Callable[[Server], None] = lambda server: None,
        log: Callable[[str], None] = print,
    ) -> None:
        self._start = start
        self.grace_s = grace_s
        self.ready_timeout = ready_timeout
        self._on_ready = on_ready
        self._log = log
        self.signals = 0
        self.restarts = 0
        self._failures: list[float] = []
        self._dead: list[Stub] = []  # stubs seen to die and not yet acted on

    def run(self) -> int:
        """Serve until stopped: 0 after a requested stop, 1 when the server cannot be started."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        server = self._start()
        if not self._wait_ready(server):
            return self._give_up(server)
        self._on_ready(server)
        while not self.signals:
            time.sleep(POLL_S)
            failure = self._failure(server)
            if failure is None or self.signals:
                continue
            began = time.monotonic()
            self._failures = [t for t in self._failures if began - t < FAILURE_WINDOW_S]
            self._failures.append(began)
            if len(self._failures) >= MAX_FAILURES:
                self._log(f"llm-serve: {failure}, {MAX_FAILURES} times in 10 minutes; giving up")
                server.kill()
                return 1
            self._log(f"llm-serve: {failure}; restarting tritonserver on the same ports")
            server.kill()
            try:
                server = self._start()
            except OSError as e:  # a port stayed taken
                self._log(f"llm-serve: cannot restart tritonserver: {e}")
                return 1
            if not self._wait_ready(server):
                return self._give_up(server)
            self.restarts += 1
            took = time.monotonic() - began
            self._log(f"llm-serve: serving again {took:.1f} s after the failure was noticed")
        return self._stop(server)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1

    def _failure(self, server: Server) -> str | None:
        code = server.process.poll()
        if code is not None:
            return f"tritonserver exited with code {code}"
        dead, self._dead = self._dead + server.check_stubs(), []
        if dead:
            names = ", ".join(f"{s.model} (pid {s.pid})" for s in dead)
            return f"the Python backend stub of {names} died"
        return None

    def _wait_ready(self, server: Server) -> bool:
        deadline = time.monotonic() + self.ready_timeout
        while not self.signals:
            code = server.process.poll()
            if code is not None:
                self._log(f"llm-serve: tritonserver exited with code {code} before it was ready")
                return False
            # Know the stubs from the start: a stub started while the model loads is recorded
            # before the server answers ready, so one that dies right after is seen to die
            # (its death is kept for the first `_failure` check).
            self._dead += server.check_stubs()
            if server.is_ready(MODEL_READY_PATH):
                return True
            if time.monotonic() >= deadline:
                self._log(f"llm-serve: tritonserver was not ready after {self.ready_timeout:.0f} s")
                return False
            time.sleep(0.5)
        return False

    def _give_up(self, server: Server) -> int:
        """The server did not become ready: a requested stop (0) or a failure (1)."""
        if self.signals:
            return self._stop(server)
        server.kill()
        return 1

    def _stop(self, server: Server) -> int:
        began = time.monotonic()
        deadline = began + self.grace_s + KILL_MARGIN_S
        if server.process.poll() is None:
            self._log(f"llm-serve: stopping (in-flight requests get up to {self.grace_s:g} s)")
            server.signal_stubs(signal.SIGTERM)  # the model drains
            server.process.send_signal(signal.SIGTERM)
        seen = self.signals
        while server.process.poll() is None and time.monotonic() < deadline:
            if self.signals > seen:
                self._log("llm-serve: second signal: killing now")
                break
            time.sleep(0.1)
        forced = server.process.poll() is None
        server.kill()
        took = time.monotonic() - began
        how = "killed after the grace period" if forced else "exited on its own"
        self._log(f"llm-serve: tritonserver {how}; stopped in {took:.1f} s")
        return 0
