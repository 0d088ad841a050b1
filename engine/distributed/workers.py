"""Ranks 1..N-1 of a tensor-parallel model instance, each in its own process.

Rank 0 lives in the engine's process: it runs the scheduler and samples. For every batch it sends
the tensor-free `ScheduledBatch` to each worker through a pipe, as one flat int64 buffer
(`ScheduledBatch.to_bytes`: no pickling, a few bytes per token), then runs its own share of the
forward; the workers run theirs, meeting rank 0 in the same collectives, and drop their copy of
the logits. An empty message ends a worker; so does rank 0's pipe closing (rank 0 exited or died),
and the processes are daemonic, so they never outlive the engine's process.

NOTE: workers are started with the "spawn" method (CUDA cannot be forked), which re-imports the
parent's main script: a script that builds a TP engine must do so under
`if __name__ == "__main__":`, as with any multiprocessing program.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import TYPE_CHECKING

import torch
import torch.multiprocessing as mp

from engine.distributed.parallel_state import ParallelState, host_store, init_parallel_state

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.scheduler.batch import ScheduledBatch

# The body of a worker process: (config, rank, port, pipe to rank 0, CPU threads). The executor
# provides it (engine/executor/tp_worker.py), so this module never imports the executor.
WorkerMain = Callable[["EngineConfig", int, int, Connection, int], None]

_POLL_S = 0.1
HELLO_TIMEOUT_S = 300.0  # a worker process starts and imports the engine
READY_TIMEOUT_S = 3600.0  # a worker builds its model and loads its shard of the checkpoint


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed or exited."""


@dataclass
class _Worker:
    rank: int
    process: SpawnProcess
    conn: Connection


class TPWorkers:
    """The worker processes (ranks 1..tp_size-1) of one model instance, seen from rank 0."""

    def __init__(
        self, config: EngineConfig, port: int, num_threads: int, target: WorkerMain
    ) -> None:
        ctx = mp.get_context("spawn")
        assert isinstance(ctx, SpawnContext)
        _use_python_executable(ctx)
        self.workers: list[_Worker] = []
        self._closed = False
        for rank in range(1, config.tp_size):
            parent, child = ctx.Pipe()
            process = ctx.Process(
                target=target,
                args=(config, rank, port, child, num_threads),
                name=f"tp-worker-{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self.workers.append(_Worker(rank, process, parent))

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers if w.process.pid is not None]

    def wait(self, expected: str, timeout: float) -> None:
        """Wait for message `expected` from every worker; raise WorkerError naming the worker
        that failed (with its traceback) or exited, or TimeoutError."""
        deadline = time.monotonic() + timeout
        for w in self.workers:
            while not w.conn.poll(_POLL_S):
                if not w.process.is_alive():
                    raise WorkerError(
                        f"tensor-parallel worker {w.rank} exited (code {w.process.exitcode}) "
                        f"before it was {expected}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel worker {w.rank} not {expected} in time")
            try:
                kind, detail = w.conn.recv()
            except EOFError:
                raise WorkerError(f"tensor-parallel worker {w.rank} exited") from None
            if kind == "error":
                raise WorkerError(f"tensor-parallel worker {w.rank} failed:\n{detail}")
            assert kind == expected, (kind, expected)

    def alive(self) -> bool:
        """Whether every worker process still runs."""
        return all(w.process.is_alive() for w in self.workers)

    def error_report(self, timeout: float = 2.0) -> str | None:
        """A failed worker's own report (its traceback), if one arrives within `timeout`: what
        rank 0 raises instead of the bare collective error it saw."""
        deadline = time.monotonic() + timeout
        while True:
            for w in self.workers:
                try:
                    if w.conn.poll():
                        kind, detail = w.conn.recv()
                        if kind == "error":
                            return f"tensor-parallel worker {w.rank} failed:\n{detail}"
                except (EOFError, OSError):
                    continue
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S)

    def send(self, batch: ScheduledBatch, all_logits: bool) -> None:
        """Hand the next batch to every worker (before rank 0 runs its own share), as one flat
        buffer (`ScheduledBatch.to_bytes`)."""
        data = batch.to_bytes(all_logits)
        for w in self.workers:
            try:
                w.conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise WorkerError(f"tensor-parallel worker {w.rank} is gone") from None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every worker and wait for it; idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self.workers:
            try:
                w.conn.send_bytes(b"")  # empty: stop
            except OSError:
                pass
        for w in self.workers:
            w.process.join(timeout)
            if w.process.is_alive():
                w.process.terminate()  # (workers of an engine process ignore SIGTERM)
                w.process.join(5.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(5.0)
            w.conn.close()


def start_tp_group(
    config: EngineConfig, device: torch.device, target: WorkerMain
) -> tuple[TPWorkers, ParallelState]:
    """Start ranks 1..tp_size-1, each running `target`, and join them as rank 0 (called in the
    engine's process)."""
    store = host_store(config.tp_size)
    threads = max(1, torch.get_num_threads() // config.tp_size) if device.type == "cpu" else 1
    workers = TPWorkers(config, store.port, threads, target)
    try:
        workers.wait("hello", HELLO_TIMEOUT_S)
        if device.type == "cuda" and device.index is not None:  # else: the current GPU
            torch.cuda.set_device(device)
        state = init_parallel_state(0, config.tp_size, store.port, device, store)
    except BaseException:
        workers.shutdown()
        raise
    return workers, state


def _use_python_executable(ctx: SpawnContext) -> None:
    """Spawned workers need a Python interpreter; inside an embedding host (Triton's Python
    backend stub) sys.executable may be the host binary, so fall back to the prefix's python."""
    exe = os.path.basename(sys.executable or "")
    if not exe.startswith("python"):
        ctx.set_executable(os.path.join(sys.exec_prefix, "bin", "python3"))
