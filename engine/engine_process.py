"""`AsyncEngine` in a child process: what the Triton model runs by default (`engine_process`).

The Python-backend stub embeds the shared libpython, whose Python code ran 1.6-1.7x slower than
`python3` on the H200 machine (perf/RESULTS.md, run E). The engine's eager prefill is Python-bound,
so inside the stub the first token came 23 ms later than in a plain process. `EngineProcess`
starts `python3 -m engine.engine_process` instead and talks to it over a socket pair: the caller
keeps the tokenizer and the request checks (so a bad request is still refused at once, in its own
thread), and sends token ids; the child runs `AsyncEngine` and sends back every step's deltas in
one message, with the engine's stats when they change.

The child ends when told to, when the socket closes, or when the thread that started it ends
(parent-death signal). If it dies on its own, every request in flight ends with an error and
`on_died` is called (the Triton model then ends its stub, which the launcher restarts).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.input_processor import InputProcessor
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Callback = Callable[[RequestOutput], None]
STATS_INTERVAL_S = 0.1  # the child sends changed stats at least this often while idle
DEAD_POLL_S = 0.2  # the child's wait for a message, between checks that its engine lives
PR_SET_PDEATHSIG = 1
_ROOT = Path(__file__).resolve().parents[1]  # the folder that holds the `engine` package


class EngineProcessError(RuntimeError):
    """The engine's process failed to start or is gone."""


def python_executable() -> str:
    """The interpreter for the child: this one, unless this process is not a python binary (the
    Triton stub embeds Python), then the first python3 on PATH (the launcher puts its own
    interpreter's folder first)."""
    exe = sys.executable
    if exe and Path(exe).name.startswith("python") and os.access(exe, os.X_OK):
        return exe
    found = shutil.which("python3")
    if found is None:
        raise EngineProcessError("no python3 on PATH to run the engine's process")
    return found


class EngineProcess:
    """The `AsyncEngine` interface the Triton model uses (`add_request`, `abort`, `stats`,
    `tokenizer`, `max_context_len`, `shutdown`), with the engine in a child process."""

    def __init__(
        self,
        config: EngineConfig,
        on_died: Callable[[str], None] | None = None,
        python: str | None = None,
    ) -> None:
        self.config = config
        self._on_died = on_died
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
        self._proc = subprocess.Popen(
            [python or python_executable(), "-m", "engine.engine_process"]
            + [str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()],
            env=env,
            start_new_session=True,  # a Ctrl-C in the terminal is the stub's to handle
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        # NOTE: messages to the child go through a queue and a sender thread, so that no
        # caller blocks on a child that stopped reading (a full socket): the stub's response
        # thread, which aborts, would stop every stream, and shutdown would never get to kill.
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._callbacks: dict[str, Callback] = {}
        self._lock = threading.Lock()  # guards _callbacks and _gone
        self._gone: str | None = None  # why the child is no longer usable
        self._stopping = False
        try:
            self._conn.send(config)
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
            raise EngineProcessError(
                f"the engine's process exited with code {code} while starting"
            ) from None
        if kind == "failed":
            self._proc.wait()
            raise payload
        info: dict[str, Any] = payload
        tokenizer = None
        if not config.skip_tokenizer_init:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(info["tokenizer_path"])
        self.tokenizer: Any = tokenizer
        self.max_context_len: int = info["max_context_len"]
        self.inputs = InputProcessor(
            tokenizer, info["vocab_size"], self.max_context_len, config.max_tokens_cap
        )
        self.pid = self._proc.pid
        self._stats: EngineStats = info["stats"]
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._write, name="engine-sender", daemon=True)
        self._sender.start()

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, callback: Callback
    ) -> None:
        """As `AsyncEngine.add_request`: checks and tokenizes here (raising ValueError or
        SamplingParamsError before anything is sent), then queues the token ids in the child."""
        ids = self.inputs.process(prompt, params)
        with self._lock:
            if self._gone is not None:
                raise EngineProcessError(self._gone)
            duplicate = request_id in self._callbacks
            if not duplicate:
                self._callbacks[request_id] = callback
        if duplicate:  # (outside the lock: the callback may add a request itself)
            _call(callback, _failed(request_id, f"request id {request_id!r} is already running"))
            return
        self._send(("add", request_id, ids, params))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        """The child's latest stats (sent after steps that changed them)."""
        return self._stats

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child (requests in flight end with "abort"), waiting `timeout` seconds before
        killing it."""
        self._stopping = True
        self._send(("shutdown",))
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the engine's process did not stop within %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.wait()
        self._outbox.put(None)  # a send blocked on the killed child has failed by now
        self._sender.join(timeout)
        if threading.current_thread() is not self._reader:  # (on_died, a callback: no join)
            self._reader.join(timeout)
        self._conn.close()

    # ---- internals ---------------------------------------------------------------------------
    def _send(self, message: tuple[Any, ...]) -> None:
        self._outbox.put(message)

    def _write(self) -> None:
        """The sender thread: the queued messages to the child, in order, until shutdown."""
        broken = False
        while (message := self._outbox.get()) is not None:
            if broken:
                continue  # the child is gone: the reader reports it
            try:
                self._conn.send(message)
            except OSError:
                broken = True

    def _read(self) -> None:
        while True:
            try:
                kind, outputs, stats = self._conn.recv()
            except (EOFError, OSError):
                break
            if stats is not None:
                self._stats = stats
            for out in outputs:
                with self._lock:
                    callback = (
                        self._callbacks.pop(out.request_id, None)
                        if out.finished
                        else self._callbacks.get(out.request_id)
                    )
                if callback is not None:
                    _call(callback, out)
        code = self._proc.wait()
        reason = f"the engine's process exited with code {code}"
        with self._lock:
            self._gone = reason
            orphans, self._callbacks = self._callbacks, {}
        for rid, callback in orphans.items():
            _call(callback, _failed(rid, reason))
        if not self._stopping:
            logger.error("%s", reason)
            if self._on_died is not None:
                self._on_died(reason)


def _call(callback: Callback, out: RequestOutput) -> None:
    """A request's callback; one that raises is logged and the reader goes on (as the engine
    core does), so that the other requests' deltas keep coming."""
    try:
        callback(out)
    except Exception:
        logger.exception("callback of request %s failed", out.request_id)


def _failed(request_id: str, error: str) -> RequestOutput:
    return RequestOutput(request_id, finished=True, finish_reason="abort", error=error)


# ---- the child ---------------------------------------------------------------------------------
def _serve(conn: Connection) -> int:
    from engine.async_engine import AsyncEngine

    config = conn.recv()
    died: list[str] = []
    try:
        # NOTE: an engine that cannot serve again (a worker died, the GPU erred for good) ends this
        # process, so that the parent's reader reports it (`on_died`) and the stub restarts.
        engine = AsyncEngine(config, on_dead=died.append)
    except BaseException as e:  # a ConfigError, a missing file, out of memory, ...
        try:
            conn.send(("failed", e))
        except Exception:  # not picklable
            conn.send(("failed", EngineProcessError(f"{type(e).__name__}: {e}")))
        return 1
    info = {
        "tokenizer_path": engine.core.runner.model_config.path,
        "vocab_size": engine.core.runner.model_config.vocab_size,
        "max_context_len": engine.max_context_len,
        "stats": engine.stats(),
    }
    conn.send(("ready", info))
    outbox: queue.SimpleQueue[RequestOutput | None] = queue.SimpleQueue()
    sender = threading.Thread(target=_send_outputs, args=(conn, engine, outbox), daemon=True)
    sender.start()
    try:
        while not died:
            try:
                if not conn.poll(DEAD_POLL_S):
                    continue
                message = conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            if message[0] == "add":
                _, rid, ids, params = message
                try:
                    engine.add_request(rid, ids, params, outbox.put)
                except (ValueError, RuntimeError) as e:  # checked by the parent; the engine died
                    outbox.put(_failed(rid, str(e)))
            elif message[0] == "abort":
                engine.abort(message[1])
            elif message[0] == "shutdown":
                break
    finally:
        engine.shutdown()  # the last deltas ("abort") go to the outbox
        outbox.put(None)
        sender.join(10)
    if died:
        logger.error("the engine cannot serve again: %s", died[0])
        return 3
    return 0


def _send_outputs(
    conn: Connection, engine: Any, outbox: queue.SimpleQueue[RequestOutput | None]
) -> None:
    """Everything the engine emitted since the last message, in one message, with its stats when
    they changed."""
    last_stats = None
    done = False
    while not done:
        batch: list[RequestOutput] = []
        try:
            item = outbox.get(timeout=STATS_INTERVAL_S)
            while True:
                if item is None:
                    done = True
                    break
                batch.append(item)
                item = outbox.get_nowait()
        except queue.Empty:
            pass
        stats = engine.stats()
        fresh = None if stats == last_stats else stats
        if batch or fresh is not None:
            last_stats = stats
            try:
                conn.send(("outs", batch, fresh))
            except OSError:
                return


def main(argv: list[str]) -> int:
    fd, parent = int(argv[0]), int(argv[1])
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        return 1  # the parent is already gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-process %(message)s")
    conn = Connection(fd)
    try:
        return _serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
