"""The model's side of the server's life: drain when told to stop, end when the server is gone.

Triton 2.51 tells a Python model nothing when the server is asked to stop: it first waits (up to
its exit timeout) for HTTP connections to close, then for in-flight requests, and only then
unloads the model. Long streams therefore keep it up until the exit timeout, after which 2.51
may crash and hang (docs/SERVING.md). So the stub listens itself: `python -m engine.serve` sends
SIGTERM to the stubs when it is stopped, and a Ctrl-C in a terminal running tritonserver directly
reaches the stub as SIGINT (same process group). Either starts a drain: the model refuses new
requests and ends the in-flight ones once `grace_s` has passed.

Python runs signal handlers in the main thread only, and the stub's main thread sits in C++, so
the handler is a no-op and the signal is read from `signal.set_wakeup_fd` by a watcher thread.
That thread also ends the stub when its server has died (the stub was re-parented): such a stub
otherwise lingers, ignoring SIGTERM, with the KV cache and the model's memory. A thread of the
stub cannot always do it: a server killed while it held a lock that the stub shares with it can
leave a stub thread blocked on that lock with the GIL held, and then no Python thread of the stub
runs again (seen under CPU load after `kill -9` of the launcher: every stub thread in a futex
wait a minute later). So a watchdog process (`python -I -S`, `_WATCHDOG`) watches the stub from
outside and kills it, and what it started, once the stub's parent is no longer the server.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

GRACE_ENV = "LLM_SHUTDOWN_GRACE_S"
DEFAULT_GRACE_S = 10.0
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def grace_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The drain's grace period: `LLM_SHUTDOWN_GRACE_S` (the launcher sets it), else 10 s."""
    raw = (os.environ if environ is None else environ).get(GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_GRACE_S
    try:
        return parse_grace(raw)
    except ValueError as e:
        raise ValueError(f"{GRACE_ENV}={raw!r}: {e}") from None


def parse_grace(raw: str) -> float:
    """A grace period in seconds: a finite number >= 0 (nan would never end a drain)."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError("must be a finite number of seconds >= 0")
    return value


# The watchdog: argv stub pid, server pid, poll seconds. It holds a pidfd of the stub (so that a
# pid reused after the stub's exit is never taken for it) and, until the stub exits, checks every
# poll that the stub's parent is still the server; once not, it removes the stub's shared-memory
# region and kills the stub and every process below it (the engine's process, tensor-parallel
# workers), each through a pidfd taken before its parent was checked. Signals aimed at a
# terminal's process group are ignored: it ends with the stub. Without pidfds (Linux < 5.3) it
# exits at once, leaving the stub's own watch thread.
_WATCHDOG = """
import os, select, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
stub, server, poll = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

def parent(pid):  # None: gone, a zombie, or unreadable
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return None
    return None if state == "Z" else int(ppid)

def handle(pid):
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None

def exited(fd, wait=0.0):
    return bool(select.select([fd], [], [], wait)[0])

stub_fd = handle(stub)
if stub_fd is None or os.getppid() != stub:
    sys.exit(0)  # no pidfds, or the stub is already gone (the handle may be another's)
while not exited(stub_fd, poll):
    up = parent(stub)
    if up is not None and up != server and not exited(stub_fd):
        break
else:
    sys.exit(0)
tree, handles, found = [stub], [stub_fd], True
while found:
    found = False
    for pid in (int(e) for e in os.listdir("/proc") if e.isdigit()):
        if pid in tree or pid == os.getpid() or parent(pid) not in tree:
            continue
        fd = handle(pid)
        if fd is not None and parent(pid) in tree:  # (checked again behind the handle)
            tree.append(pid)
            handles.append(fd)
            found = True
try:
    with open(f"/proc/{stub}/cmdline", "rb") as f:
        for arg in f.read().decode(errors="replace").split("\\0"):
            if arg.startswith("triton_python_backend_shm_region"):
                os.unlink(os.path.join("/dev/shm", arg))
except OSError:
    pass
for fd in handles:
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
"""


class ServerLifecycle:
    """Watches for a drain signal and for the death of the server (this process's parent).

    `draining` turns true on SIGTERM/SIGINT (or `start_drain()`); `drain_deadline` is then the
    monotonic time after which requests still running are ended. `on_orphaned` runs on the
    watcher thread once the parent is gone; by default it kills this process (and its
    multiprocessing children) after removing the stub's shared-memory region.
    """

    def __init__(
        self,
        grace_s: float,
        on_orphaned: Callable[[], None] | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self.grace_s = grace_s
        self._drain_at: float | None = None
        self._ppid = os.getppid()
        self._on_orphaned = on_orphaned or _die_with_server
        self._poll_s = poll_s
        self._rfd, wfd = os.pipe()
        os.set_blocking(wfd, False)
        self.signals_hooked = _hook_signals(wfd)
        self._thread = threading.Thread(target=self._watch, name="llm-lifecycle", daemon=True)
        self._thread.start()
        self.watchdog = _start_watchdog(self._ppid, poll_s)

    @property
    def draining(self) -> bool:
        return self._drain_at is not None

    @property
    def drain_deadline(self) -> float | None:
        return None if self._drain_at is None else self._drain_at + self.grace_s

    def start_drain(self) -> None:
        if self._drain_at is None:
            self._drain_at = time.monotonic()

    def _watch(self) -> None:
        while True:
            ready, _, _ = select.select([self._rfd], [], [], self._poll_s)
            if ready and any(b in DRAIN_SIGNALS for b in os.read(self._rfd, 64)):
                self.start_drain()
            if os.getppid() != self._ppid:
                self._on_orphaned()
                return


def _start_watchdog(server: int, poll_s: float) -> subprocess.Popen[bytes] | None:
    """The watchdog process of this process (see `_WATCHDOG`), whose parent is `server`; None
    (with a warning) where no Python interpreter can run it."""
    from engine.engine_process import python_executable  # (the stub's sys.executable is no python)

    try:
        cmd = [python_executable(), "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(server)]
        cmd.append(str(poll_s))
        quiet = subprocess.DEVNULL  # (holding the stub's pipes open would keep its reader waiting)
        return subprocess.Popen(cmd, stdin=quiet, stdout=quiet, stderr=quiet, close_fds=True)
    except (OSError, RuntimeError) as e:  # (EngineProcessError: no python3 on PATH)
        logger.warning("no watchdog process for this stub: %s", e)
        return None


def _hook_signals(wakeup_fd: int) -> bool:
    """Route SIGTERM/SIGINT to `wakeup_fd`; False where that is impossible (not the main thread)."""
    try:
        for signum in DRAIN_SIGNALS:
            signal.signal(signum, _ignore)
        signal.set_wakeup_fd(wakeup_fd, warn_on_full_buffer=False)
    except ValueError:
        return False
    return True


def _ignore(signum: int, frame: object) -> None:
    """The Python-level handler: nothing (the watcher thread reads the wakeup fd)."""


def _die_with_server() -> None:
    try:
        argv = Path("/proc/self/cmdline").read_bytes().decode(errors="replace").split("\0")
        for arg in argv:
            if arg.startswith("triton_python_backend_shm_region"):
                Path("/dev/shm", arg).unlink(missing_ok=True)  # nobody else will remove it now
    except OSError:
        pass
    for child in multiprocessing.active_children():  # tensor-parallel workers
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)
