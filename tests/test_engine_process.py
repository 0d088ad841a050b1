"""EngineProcess (engine/engine_process.py): the engine in a child process, as the Triton model
runs it. Same tokens as the offline engine, requests refused in the caller, aborts, shutdown,
and a child that dies or a parent that dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine import LLM
from engine.config import ConfigError, EngineConfig
from engine.engine_process import EngineProcess, EngineProcessError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class Collector:
    """A request's deltas, and an event set by its final one."""

    def __init__(self) -> None:
        self.deltas: list[RequestOutput] = []
        self.done = threading.Event()

    def __call__(self, out: RequestOutput) -> None:
        self.deltas.append(out)
        if out.finished:
            self.done.set()

    def wait(self, timeout: float = 60.0) -> RequestOutput:
        assert self.done.wait(timeout), "no final delta"
        return self.deltas[-1]

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]


def _config(model: str, **overrides: object) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", max_total_tokens=2048, **overrides)  # type: ignore[arg-type]


def _gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def engine(tiny_llama: str):
    ep = EngineProcess(_config(tiny_llama, max_tokens_cap=64))
    yield ep
    ep.shutdown()


def test_streams_the_offline_engines_tokens(engine: EngineProcess, tiny_llama: str) -> None:
    prompts = ["Hello there", "The quick brown fox", [5, 6, 7, 8, 9]]
    offline = LLM(tiny_llama, device="cpu", max_total_tokens=2048)
    want = [o.token_ids for o in offline.generate(prompts, GREEDY)]
    got = [Collector() for _ in prompts]
    for i, (prompt, c) in enumerate(zip(prompts, got, strict=True)):
        engine.add_request(f"r{i}", prompt, GREEDY, c)
    for c in got:
        final = c.wait()
        assert final.finish_reason == "length" and final.error is None
    assert [c.token_ids for c in got] == want
    assert "".join(d.text for d in got[0].deltas)  # detokenized in the child
    stats = engine.stats()  # sent by the child after the steps
    deadline = time.monotonic() + 5
    while stats.generation_tokens_total < 3 * 12 and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = engine.stats()
    assert stats.generation_tokens_total >= 3 * 12 and stats.num_running == 0


def test_bad_requests_are_refused_in_the_caller(engine: EngineProcess) -> None:
    never = Collector()
    with pytest.raises(SamplingParamsError, match="max_tokens_cap"):
        engine.add_request("cap", "hi", SamplingParams(max_tokens=65), never)
    with pytest.raises(ValueError, match="context limit"):
        engine.add_request("long", list(range(10, 10 + engine.max_context_len)), GREEDY, never)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("vocab", [10**9], GREEDY, never)
    assert not never.deltas
    # the engine still serves
    ok = Collector()
    engine.add_request("after", "fine", SamplingParams(max_tokens=2), ok)
    assert ok.wait().error is None


def test_duplicate_id_and_abort(engine: EngineProcess) -> None:
    long = Collector()
    engine.add_request("dup", "count", SamplingParams(max_tokens=60, ignore_eos=True), long)
    second = Collector()
    engine.add_request("dup", "again", GREEDY, second)
    assert "already running" in (second.wait().error or "")
    engine.abort("dup")
    final = long.wait()
    assert final.finish_reason == "abort" and sum(len(d.token_ids) for d in long.deltas) < 60


def test_a_failing_callback_leaves_the_other_requests_served(engine: EngineProcess) -> None:
    """A request whose callback raises does not stop the reader: the next request still gets
    its deltas."""

    def broken(out: RequestOutput) -> None:
        raise RuntimeError("a broken consumer")

    engine.add_request("broken", "hi", SamplingParams(max_tokens=2), broken)
    ok = Collector()
    engine.add_request("fine", "hello", SamplingParams(max_tokens=2), ok)
    assert ok.wait().error is None


def test_a_callback_that_adds_a_request_on_a_duplicate_id(engine: EngineProcess) -> None:
    """The duplicate-id refusal runs its callback outside the engine's lock: a callback that
    retries under another id does not deadlock its thread (nor, later, the reader)."""
    first = Collector()
    engine.add_request("twice", "count", SamplingParams(max_tokens=40, ignore_eos=True), first)
    retried = Collector()

    def retry(out: RequestOutput) -> None:
        engine.add_request("twice-2", "again", GREEDY, retried)

    adder = threading.Thread(target=engine.add_request, args=("twice", "again", GREEDY, retry))
    adder.start()
    adder.join(30)
    assert not adder.is_alive(), "add_request deadlocked in its own callback"
    assert retried.wait().error is None and first.wait().error is None


def test_start_up_errors_reach_the_caller(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        EngineProcess(_config(str(tmp_path)))


def test_a_dead_child_fails_its_requests(tiny_llama: str) -> None:
    died: list[str] = []
    ep = EngineProcess(_config(tiny_llama), on_died=died.append)
    c = Collector()
    ep.add_request("a", "hello", SamplingParams(max_tokens=2000, ignore_eos=True), c)
    os.kill(ep.pid, signal.SIGKILL)
    final = c.wait(30)
    assert final.finish_reason == "abort" and "exited with code -9" in (final.error or "")
    deadline = time.monotonic() + 5
    while not died and time.monotonic() < deadline:
        time.sleep(0.05)
    assert died and "exited" in died[0]
    with pytest.raises(EngineProcessError, match="exited"):
        ep.add_request("b", "hello", GREEDY, Collector())
    ep.shutdown()


def test_shutdown_ends_requests_and_the_child(tiny_llama: str) -> None:
    ep = EngineProcess(_config(tiny_llama))
    c = Collector()
    ep.add_request("a", "hello", SamplingParams(max_tokens=2000, ignore_eos=True), c)
    while not c.deltas:
        time.sleep(0.01)
    ep.shutdown()
    assert c.wait(5).finish_reason == "abort"
    assert _gone(ep.pid, 5)


def test_the_child_ends_with_its_parent(tiny_llama: str, tmp_path: Path) -> None:
    """A parent killed with SIGKILL (a Triton stub that crashed) takes the engine with it."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import sys, time\n"
        "from engine.config import EngineConfig\n"
        "from engine.engine_process import EngineProcess\n"
        f"ep = EngineProcess(EngineConfig(model={tiny_llama!r}, device='cpu'))\n"
        f"open({str(pid_file)!r}, 'w').write(str(ep.pid))\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert not _gone(child, 0.2)
    finally:
        parent.kill()
        parent.wait()
    assert _gone(child, 10)


def test_a_pool_smaller_than_one_page_is_refused() -> None:
    """max_total_tokens 2 with pages of 4 rounded down to a pool of 0 slots, and every prompt
    was then refused with 'the context limit is 0', which did not say why."""
    with pytest.raises(ConfigError, match="hold one page"):
        EngineConfig(model="m", max_total_tokens=2, page_size=4)
    assert EngineConfig(model="m", max_total_tokens=4, page_size=4).max_total_tokens == 4


def test_a_context_longer_than_the_model_s_positions_is_refused(default_model: str) -> None:
    """max_context_len above max_position_embeddings (8192 for the default model) was taken as
    is: positions past the trained RoPE range ran on and degraded the output with no error."""
    with pytest.raises(ConfigError, match="above the model's max_position_embeddings 8192"):
        LLM(default_model, device="cpu", max_context_len=8193)
    with pytest.raises(ConfigError, match="max_context_len must be >= 2"):
        EngineConfig(model="m", max_context_len=0)
    llm = LLM(default_model, device="cpu", max_context_len=8192, max_total_tokens=256)
    try:
        assert llm.core.max_context_len == 256  # capped at the pool, as before
    finally:
        llm.shutdown()


def test_a_child_that_stops_reading_blocks_no_caller(tiny_llama: str) -> None:
    """A child alive but not reading (here stopped): once the socket is full, add_request and
    abort still return (the sends are queued for a sender thread), and shutdown kills it after
    its timeout instead of waiting on a send."""
    ep = EngineProcess(_config(tiny_llama))
    os.kill(ep.pid, signal.SIGSTOP)
    try:
        prompt = list(range(10, 400))
        calls = threading.Thread(
            target=lambda: [
                (ep.add_request(f"r{i}", prompt, GREEDY, Collector()), ep.abort(f"r{i}"))
                for i in range(300)  # far more than the socket holds
            ],
            daemon=True,
        )
        calls.start()
        calls.join(30)
        assert not calls.is_alive(), "add_request or abort blocked on the stopped child"
        stopper = threading.Thread(target=ep.shutdown, kwargs={"timeout": 2.0}, daemon=True)
        stopper.start()
        stopper.join(30)
        assert not stopper.is_alive(), "shutdown blocked on the stopped child"
        assert _gone(ep.pid, 5)
    finally:
        if not _gone(ep.pid, 0.1):
            os.kill(ep.pid, signal.SIGKILL)


def test_shutdown_from_a_callback(tiny_llama: str) -> None:
    """shutdown() called on the reader thread (a final delta's callback, or on_died) stops
    the child and closes the connection instead of failing to join its own thread."""
    ep = EngineProcess(_config(tiny_llama))
    errors: list[BaseException] = []
    done = threading.Event()

    def stop_on_final(out: RequestOutput) -> None:
        if out.finished:
            try:
                ep.shutdown()
            except BaseException as e:  # noqa: BLE001 (what the test looks for)
                errors.append(e)
            done.set()

    ep.add_request("a", "hello", SamplingParams(max_tokens=2), stop_on_final)
    assert done.wait(60) and not errors, errors
    assert _gone(ep.pid, 5) and ep._conn.closed
