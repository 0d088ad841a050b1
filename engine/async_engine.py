"""The serving engine: one background thread runs the engine loop; any thread submits work."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.config import EngineConfig
from engine.engine_core import Callback, EngineCore
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


class AsyncEngine:
    """Thread-safe front of the engine.

    `add_request` validates and tokenizes in the caller's thread (raising ValueError before
    anything is queued), then hands the request to the loop thread. The callback runs on the loop
    thread once per delta, exactly once with `finished=True`; keep it cheap.
    """

    def __init__(self, config: EngineConfig, on_dead: Callable[[str], None] | None = None) -> None:
        """`on_dead(reason)` runs on the loop thread when the engine cannot serve again (a
        tensor-parallel worker died, the GPU holds a sticky error, or the loop's own
        bookkeeping failed), after every request has ended with that reason; later requests
        are refused."""
        self.config = config
        self._on_dead = on_dead
        self.dead: str | None = None
        self.core = EngineCore(config)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = threading.Lock()  # a request is queued wholly before a stop, or refused
        self._stats = self.core.stats()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def max_context_len(self) -> int:
        return self.core.max_context_len

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        callback: Callback,
    ) -> None:
        """Queue a request; raise ValueError (before tokenizing, where it can) if it cannot run.

        SamplingParamsError when `max_tokens` is above `EngineConfig.max_tokens_cap`; ValueError
        for a prompt that cannot fit (engine.input_processor).
        """
        if self._stop.is_set():
            raise RuntimeError(f"the engine {self._gone()}")
        ids = self.core.inputs.process(prompt, params)
        with self._accepting:
            if self._stop.is_set():
                raise RuntimeError(f"the engine {self._gone()}")
            self._submit(lambda: self._add(request_id, ids, params, callback))

    def _add(self, rid: str, ids: list[int], params: SamplingParams, callback: Callback) -> None:
        try:
            self.core.add_request(rid, ids, params, callback)
        except ValueError as e:  # a duplicate id: report it to this request only
            callback(RequestOutput(rid, finished=True, finish_reason="abort", error=str(e)))
        except Exception as e:  # anything else that refused it: this request's error too
            logger.exception("adding request %s failed", rid)
            error = f"the request could not be added: {e!r}"
            callback(RequestOutput(rid, finished=True, finish_reason="abort", error=error))

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self.core.abort(request_id))

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's deltas; aborts it if the consumer stops early."""
        rid = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def on_delta(delta: RequestOutput) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, delta)

        self.add_request(rid, prompt, params, on_delta)
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(rid)

    def stats(self) -> EngineStats:
        """The latest snapshot, refreshed by the loop thread after every step."""
        return self._stats

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (requests in flight, and those queued before the stop, end with an
        error), then the model's workers."""
        with self._accepting:
            self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.core.shutdown()

    def _submit(self, fn: Callable[[], None]) -> None:
        self._inbox.put(fn)
        self._wake.set()

    def _run_inbox(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:  # one bad item must not end the loop thread (and every request)
                logger.exception("engine inbox item failed")

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the loop's own bookkeeping failed: serve no more
            logger.exception("engine loop failed")
            self.dead = self.dead or f"the engine loop failed ({e!r}); the engine must be restarted"
            with self._accepting:
                self._stop.set()
        try:
            self._run_inbox()  # requests accepted before the stop: failed below, not lost
            self.core.fail_all(self.dead or "the engine is shutting down")
        finally:
            if self.dead is not None and self._on_dead is not None:
                self._on_dead(self.dead)

    def _serve(self) -> None:
        """Step until stopped, or until a failed step leaves the engine unable to serve."""
        while not self._stop.is_set():
            self._run_inbox()
            try:
                ran = self.core.step() if self.core.has_work() else False
            except Exception as e:  # keep serving: fail the requests in flight, not the server
                logger.exception("engine step failed")
                clean = self.core.fail_all(f"engine error: {e}")
                ran = True
                lost = None if clean else f"ending the requests after {e!r} failed"
                self.dead = self.core.broken() or lost
                if self.dead is not None:  # unless it cannot serve again
                    with self._accepting:
                        self._stop.set()
                    return
            self._stats = self.core.stats()
            if not ran:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()

    def _gone(self) -> str:
        return "is shut down" if self.dead is None else f"failed: {self.dead}"
