"""The body of a tensor-parallel worker process (ranks 1..N-1).

engine/distributed/workers.py starts the processes and passes each the pipe from rank 0; this
module is what they run: join the group, build this rank's runner, then run every batch rank 0
sends, in order, until told to stop. The runner class comes in as an argument (rank 0 binds it
with `functools.partial`), so this module sits below model_runner.py and imports nothing above it.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig, ModelConfig
from engine.distributed.parallel_state import ParallelState, init_parallel_state
from engine.executor.device import resolve_device
from engine.scheduler.batch import ScheduledBatch

if TYPE_CHECKING:
    from engine.executor.model_runner import ModelRunner

# Builds a worker's runner: ModelRunner(config, parallel=...).
RunnerFactory = Callable[..., "ModelRunner"]


def check_tp_split(mc: ModelConfig, tp_size: int) -> None:
    """Raise ConfigError now if `tp_size` ranks cannot share the model's heads."""
    rank0 = ParallelState(0, tp_size)
    if mc.is_mla:
        rank0.shard(mc.num_attention_heads, "attention heads")
    else:
        rank0.shard(mc.num_key_value_heads, "KV heads")


def worker_main(
    make_runner: RunnerFactory,
    config: EngineConfig,
    rank: int,
    port: int,
    conn: Connection,
    num_threads: int,
) -> None:
    """Run tensor-parallel worker `rank` until rank 0 sends the empty stop message or its pipe
    closes. The worker takes the same path through every forward as rank 0 (the same batch,
    config and model), so the ranks meet in the same collectives: the layers' all-reduces, the
    logits' all-gather, and the broadcast of placeholder input ids under the overlap schedule."""
    torch.set_num_threads(num_threads)
    try:
        # NOTE: "hello" only once the device is set: rank 0 then joins the group, and a failure
        # before it would leave rank 0 waiting there for the group's whole timeout.
        device = resolve_device(config.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("hello", None))
        parallel = init_parallel_state(rank, config.tp_size, port, device)
        runner = make_runner(config, parallel=parallel)
    except BaseException:
        _report(conn, rank)
        return
    conn.send(("ready", None))
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # rank 0 is gone
            break
        if not data:  # rank 0's stop message
            break
        batch, all_logits = ScheduledBatch.from_bytes(data)
        try:
            runner.forward(batch, all_logits)
        except BaseException:
            _report(conn, rank)  # rank 0's collective fails next; it reads this report
            break
    runner.shutdown()


def _report(conn: Connection, rank: int) -> None:
    """This worker's traceback to its stderr and to rank 0 (which raises it as WorkerError)."""
    detail = traceback.format_exc()
    sys.stderr.write(f"tensor-parallel worker {rank} failed:\n{detail}")
    try:
        conn.send(("error", detail))
    except OSError:
        pass  # rank 0 is gone
