"""Tensor parallelism on CPU (gloo): greedy output with tp_size > 1 equals tp_size 1, and the
worker processes end with the engine.

The default model (SmolLM2: 9 query heads in 3 KV groups) splits unevenly over 2 ranks (6 + 3
query heads, 2 + 1 KV heads); the DeepSeek checkpoints have 4 heads (2 + 2) and MoE on.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.distributed.sharding import ShardSpec, shard_range

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Token-id prompts: two share a prefix (radix cache), one is long enough for two prefill chunks.
PROMPTS: list[list[int]] = [
    [1, 504, 3458, 282, 4649, 314],
    [1, 504, 3458, 282, 4649, 314, 260, 1345, 43],
    [(37 * i + 11) % 4000 + 100 for i in range(70)],
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Rank 0 and each worker use one thread (workers take the parent's count / tp_size)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _llm(model: str, tp_size: int) -> LLM:
    return LLM(
        model,
        dtype="float32",
        tp_size=tp_size,
        max_total_tokens=512,
        max_running_requests=4,
        chunked_prefill_size=48,
        debug_checks=True,
    )


def _greedy(model: str, tp_size: int) -> list[list[int]]:
    llm = _llm(model, tp_size)
    try:
        return [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.core.shutdown()


def test_shard_range_covers_every_unit_once() -> None:
    for total in (3, 9, 16, 49152):
        for world in (1, 2, 3, 4):
            if total < world:
                continue
            ranges = [shard_range(total, world, r) for r in range(world)]
            assert ranges[0][0] == 0
            assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
            assert sum(n for _, n in ranges) == total
            assert max(n for _, n in ranges) - min(n for _, n in ranges) <= 1
    spec = ShardSpec(dim=1, start=2, size=3, full=8)
    full = torch.arange(16).view(2, 8)
    assert spec.full_shape((2, 3)) == (2, 8)
    assert spec.select(full).tolist() == [[2, 3, 4], [10, 11, 12]]


@pytest.mark.parametrize("arch,tp_size", [("v2", 2), ("v3", 3)])
def test_mla_moe_tp_greedy_equals_tp1(tiny_mla, arch: str, tp_size: int) -> None:
    """V2 over 2 ranks; V3 over 3 (uneven: 2 + 1 + 1 heads, 22 + 21 + 21 MoE features)."""
    path = tiny_mla(arch, moe=True, q_lora_rank=24 if arch == "v3" else None)
    expected = _greedy(path, 1)
    llm = _llm(path, tp_size)
    workers = llm.core.runner.workers
    assert workers is not None and len(workers.pids) == tp_size - 1
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    llm.core.scheduler.check_integrity()
    # Rank 0 holds its share of the heads and of each expert, and the whole latent KV row.
    runner = llm.core.runner
    attn = runner.model.mla_layers()[0]  # type: ignore[operator]
    assert attn.num_heads == 2
    experts = runner.model.model.layers[1].mlp.experts  # type: ignore[union-attr]
    assert experts.intermediate_size == shard_range(64, tp_size, 0)[1]
    mc = runner.model_config
    assert runner.kv_pool.get_kv(0, torch.tensor([1]))[0].shape[-1] == mc.kv_cache_dim
    # Dropping the engine without shutdown() still stops the workers.
    processes = [w.process for w in workers.workers]
    del llm, runner, attn, experts, workers
    gc.collect()
    for process in processes:
        process.join(30)
    assert [p.exitcode for p in processes] == [0] * (tp_size - 1)


def test_default_model_tp2_greedy_equals_tp1(default_model: str) -> None:
    expected = _greedy(default_model, 1)
    llm = _llm(default_model, 2)
    workers = llm.core.runner.workers
    assert workers is not None
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
        text = llm.generate("The capital of France is", PARAMS)[0].text
        assert "Paris" in text
    finally:
        llm.core.shutdown()
    assert [w.process.exitcode for w in workers.workers] == [0]


def test_tp_larger_than_kv_heads_is_a_clear_error(default_model: str) -> None:
    with pytest.raises(ConfigError, match="tp_size=4 cannot split the model's 3 KV heads"):
        LLM(default_model, dtype="float32", tp_size=4, max_total_tokens=64)


def test_a_worker_that_cannot_take_its_device_says_so_before_hello() -> None:
    """A worker failing before the process group (no GPU for its rank, ...) sends its error
    instead of "hello": rank 0 raises it at once instead of waiting in the group's rendezvous
    for its whole timeout."""
    import multiprocessing as mp

    from engine.config import EngineConfig
    from engine.executor.tp_worker import worker_main

    parent, child = mp.Pipe()
    config = EngineConfig(device="cuda:7", tp_size=2)  # no such GPU on this machine
    worker_main(lambda *a, **k: None, config, 1, 0, child, 1)  # type: ignore[arg-type]
    kind, detail = parent.recv()
    assert kind == "error" and detail, (kind, detail)
    assert not parent.poll()


def test_a_dead_worker_ends_the_engine_process(tiny_llama: str) -> None:
    """A tensor-parallel worker killed under an EngineProcess: its requests end with an error,
    and the engine's process exits so that `on_died` fires (the served stub restarts), instead
    of a live engine failing every later request."""
    import os
    import signal
    import subprocess
    import threading
    import time

    from engine.config import EngineConfig
    from engine.engine_process import EngineProcess

    config = EngineConfig(
        model=tiny_llama, device="cpu", dtype="float32", max_total_tokens=512, tp_size=2
    )
    died: list[str] = []
    ep = EngineProcess(config, on_died=died.append)
    try:
        done = threading.Event()
        ep.add_request("r1", [1, 2, 3], PARAMS, lambda o: o.finished and done.set())
        assert done.wait(60)
        kids = subprocess.run(
            ["pgrep", "-P", str(ep.pid)], capture_output=True, text=True
        ).stdout.split()
        workers = [k for k in kids if "spawn_main" in open(f"/proc/{k}/cmdline").read()]
        workers = [
            k for k in workers if "resource_tracker" not in open(f"/proc/{k}/cmdline").read()
        ]
        assert workers, kids
        for k in workers:
            os.kill(int(k), signal.SIGKILL)
        finals = []
        for i in range(2):
            end = threading.Event()
            ep.add_request(
                f"r{i + 2}",
                [1, 2, 3],
                PARAMS,
                lambda o, end=end: o.finished and (finals.append(o), end.set()),
            )
            assert end.wait(60)
        assert all(o.error for o in finals), finals
        deadline = time.monotonic() + 30
        while not died and time.monotonic() < deadline:
            time.sleep(0.1)
        assert died and "exited with code 3" in died[0], died
    finally:
        ep.shutdown()
