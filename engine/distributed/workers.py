"""Ranks 1..N-1 of a tensor-parallel model instance, each in its own process.

Rank 0 lives in the engine's process: it runs the scheduler and samples. For every batch it sends
the tensor-free `ScheduledBatch` to each worker through a pipe, then runs its own share of the
forward; the workers run theirs, meeting rank 0 in the same collectives, and drop their copy of
the logits. A `None` message ends a worker; so does rank 0's pipe closing (rank 0 exited or died),
and the processes are daemonic, so they never outlive the engine's process.

NOTE: workers are started with the "spawn" method (CUDA cannot be forked), which re-imports the
parent's main script: a script that builds a TP engine must do so under
`if __name__ == "__main__":`, as with any multiprocessing program.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from engine.distributed.parallel_state import ParallelState, host_store, init_parallel_state

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.executor.forward_batch import ScheduledBatch

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

    def __init__(self, config: EngineConfig, port: int, num_threads: int) -> None:
        ctx = mp.get_context("spawn")
        assert isinstance(ctx, SpawnContext)
        _use_python_executable(ctx)
        self.workers: list[_Worker] = []
        self._closed = False
        for rank in range(1, config.tp_size):
            parent, child = ctx.Pipe()
            process = ctx.Process(
                target=worker_main,
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

    def send(self, batch: ScheduledBatch, all_logits: bool) -> None:
        """Hand the next batch to every worker (before rank 0 runs its own share)."""
        for w in self.workers:
            try:
                w.conn.send((batch, all_logits))
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise WorkerError(f"tensor-parallel worker {w.rank} is gone") from None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every worker and wait for it; idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self.workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self.workers:
            w.process.join(timeout)
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(5.0)
            w.conn.close()


def start_tp_group(config: EngineConfig, device: torch.device) -> tuple[TPWorkers, ParallelState]:
    """Start ranks 1..tp_size-1 and join them as rank 0 (called in the engine's process)."""
    store = host_store(config.tp_size)
    threads = max(1, torch.get_num_threads() // config.tp_size) if device.type == "cpu" else 1
    workers = TPWorkers(config, store.port, threads)
    try:
        workers.wait("hello", HELLO_TIMEOUT_S)
        if device.type == "cuda" and device.index is not None:  # else: the current GPU
            torch.cuda.set_device(device)
        state = init_parallel_state(0, config.tp_size, store.port, device, store)
    except BaseException:
        workers.shutdown()
        raise
    return workers, state


def worker_main(
    config: EngineConfig, rank: int, port: int, conn: Connection, num_threads: int
) -> None:
    """Body of worker `rank`: join the group, build this rank's model runner, then run every
    batch rank 0 sends until told to stop."""
    from engine.executor.model_runner import ModelRunner, resolve_device

    torch.set_num_threads(num_threads)
    try:
        conn.send(("hello", None))
        device = resolve_device(config.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        parallel = init_parallel_state(rank, config.tp_size, port, device)
        runner = ModelRunner(config, parallel=parallel)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg: Any = conn.recv()
        except EOFError:  # rank 0 is gone
            break
        if msg is None:
            break
        batch, all_logits = msg
        runner.forward(batch, all_logits)
    parallel.close()


def _use_python_executable(ctx: SpawnContext) -> None:
    """Spawned workers need a Python interpreter; inside an embedding host (Triton's Python
    backend stub) sys.executable may be the host binary, so fall back to the prefix's python."""
    exe = os.path.basename(sys.executable or "")
    if not exe.startswith("python"):
        ctx.set_executable(os.path.join(sys.exec_prefix, "bin", "python3"))
