"""The engine loop body: schedule a batch, run it, sample, detokenize, report deltas.

`EngineCore.step()` is driven by the caller's thread in `LLM` and by a background thread in
`AsyncEngine`; both use this one implementation. Only the driving thread may call its methods
other than the read-only properties.

The overlap schedule (`enable_overlap`, SGLang's zero-overhead scheduler in a light form): step
n+1 is scheduled and queued on the device before the tokens of step n are processed, so the
host detokenizes, checks stop conditions and streams step n while the device runs step n+1.
A decode input whose token is still on the device is a placeholder that the model runner reads
from step n's sampled ids. A request that step n finishes has a row in step n+1 too: its token
there is dropped, and so is the KV slot that step writes (`Scheduler.finish`), so outputs and the
prefix cache are the same as without overlap.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from transformers import AutoTokenizer

from engine.batch_log import BatchLog
from engine.config import ConfigError, EngineConfig
from engine.detokenizer import IncrementalDetokenizer, NoDetokenizer, check_tokenizer_files
from engine.executor.launched_step import LaunchedStep, SampleRequest
from engine.executor.model_runner import ModelRunner
from engine.gc_control import freeze_startup_objects
from engine.input_processor import InputProcessor
from engine.outputs import EngineStats, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler.request import Req
from engine.scheduler.scheduler import ScheduleOutput, Scheduler

logger = logging.getLogger(__name__)

Callback = Callable[[RequestOutput], None]


@dataclass(eq=False)
class _ReqState:
    req: Req
    callback: Callback
    detokenizer: IncrementalDetokenizer | NoDetokenizer
    stop_ids: frozenset[int]
    metrics: RequestMetrics
    cumulative_logprob: float = 0.0
    pending: RequestOutput | None = field(default=None)


@dataclass(eq=False)
class _Family:
    """A request of n sequences, each running as a request of its own (`children`)."""

    rid: str
    callback: Callback
    children: list[str]
    live: set[int] = field(default_factory=set)  # the sequences not finished yet
    error: str | None = None
    metrics: RequestMetrics | None = None  # the request's: the first arrival, first token

    def __post_init__(self) -> None:
        self.live = set(range(len(self.children)))

    def merge_metrics(self, seq: RequestMetrics | None) -> None:
        if seq is None:
            return
        if self.metrics is None:
            self.metrics = RequestMetrics(seq.arrival, seq.first_scheduled, seq.first_token)
        m = self.metrics
        m.arrival = min(m.arrival, seq.arrival)
        m.first_scheduled = _earliest(m.first_scheduled, seq.first_scheduled)
        m.first_token = _earliest(m.first_token, seq.first_token)
        m.finished = seq.finished


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


class _TokenLogprobs(NamedTuple):
    """A sampled token's raw log-probability, its rank, and the step's most likely tokens."""

    value: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class _Launched:
    """A batch queued on the device whose sampled tokens are not processed yet."""

    out: ScheduleOutput
    step: LaunchedStep
    # The next batch cannot be scheduled before these tokens are known: a penalty reads the
    # whole history of its request on the host.
    blocks_scheduling: bool


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if not config.skip_tokenizer_init:
            try:  # before loading weights: a clear error, not transformers' after a long load
                check_tokenizer_files(config.model)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.runner = ModelRunner(config)
        self.tokenizer: Any = None
        if not config.skip_tokenizer_init:
            self.tokenizer = AutoTokenizer.from_pretrained(self.runner.model_config.path)
        self.eos_token_ids = frozenset(self.runner.model_config.eos_token_ids)
        self.inputs = InputProcessor(
            self.tokenizer,
            self.runner.model_config.vocab_size,
            self.runner.max_context_len,
            config.max_tokens_cap,
        )
        self.scheduler = Scheduler(
            config,
            self.runner.max_total_tokens,
            self.runner.max_context_len,
            self.runner.max_running_requests,
        )
        self.batch_log = BatchLog(self.scheduler, config.decode_log_interval)
        self.states: dict[str, _ReqState] = {}
        self.families: dict[str, _Family] = {}  # requests of n > 1 sequences, by their id
        self.finished_total: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.overlap = self._use_overlap()
        self._launched: _Launched | None = None  # the overlap schedule's batch in flight
        self.last_wait_s = 0.0  # seconds the last step() waited for the device (benchmarks)
        freeze_startup_objects()  # the start-up's objects out of later full collections

    def _use_overlap(self) -> bool:
        """`enable_overlap`; None (auto) means on a GPU, with or without tensor parallelism (rank
        0 broadcasts placeholder inputs to the workers on the device: ModelRunner
        `_resolve_placeholders`)."""
        enabled = self.config.enable_overlap
        if enabled is None:
            enabled = self.runner.device.type == "cuda"
        return enabled

    # ---- inputs ------------------------------------------------------------------------------
    @property
    def max_context_len(self) -> int:
        return self.runner.max_context_len  # already capped at the KV pool's size

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (text is encoded as `tokenizer(text)` would), validated."""
        return self.inputs.tokenize(prompt)

    def add_request(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, callback: Callback
    ) -> None:
        """Queue a request. One of `n` sequences runs as requests of its own (ids `rid/0` ...
        `rid/n-1`), reported to `callback` under `rid` with their `index`."""
        if rid in self.states or rid in self.families:
            raise ValueError(f"request id {rid!r} is already running")
        self.check_params(params)
        if params.n == 1:
            self._admit(self._new_state(rid, prompt_ids, params, callback))
            return
        children = [f"{rid}/{i}" for i in range(params.n)]
        for child in children:
            if child in self.states or child in self.families:
                raise ValueError(f"request id {child!r} (a sequence of {rid!r}) is already running")
        family = _Family(rid, callback, children)
        # (every state first: all that can fail does so before the scheduler has any of them;
        # the scheduler refuses the prompt, if at all, with the first sequence)
        states = [
            self._new_state(
                child, prompt_ids, params.for_sequence(i),
                functools.partial(self._on_sequence, family, i),
            )
            for i, child in enumerate(children)
        ]  # fmt: skip
        self._admit(states[0])
        self.families[rid] = family
        for state in states[1:]:
            self._admit(state)

    def _new_state(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, callback: Callback
    ) -> _ReqState:
        req = Req(rid=rid, prompt_ids=prompt_ids, params=params, arrival=0)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        # NOTE: all that can fail (the detokenizer decodes the prompt's tail) before the
        # scheduler has the request: one it schedules without a state would fail every step.
        return _ReqState(
            req=req,
            callback=callback,
            detokenizer=self._detokenizer(prompt_ids, params),
            stop_ids=frozenset(stop_ids),
            metrics=RequestMetrics(arrival=time.monotonic()),
        )

    def _admit(self, state: _ReqState) -> None:
        self.scheduler.add_request(state.req)
        self.states[state.req.rid] = state

    def _on_sequence(self, family: _Family, index: int, delta: RequestOutput) -> None:
        """A sequence's delta, reported as its request's: the request finishes with its last
        sequence (carrying the first error any of them had)."""
        delta.request_id = family.rid
        delta.index = index
        if delta.finished:
            family.live.discard(index)
            family.error = family.error or delta.error
            family.merge_metrics(delta.metrics)
            delta.finished = not family.live
            delta.error = family.error if delta.finished else None
            delta.metrics = family.metrics if delta.finished else None
            if delta.finished:
                del self.families[family.rid]
        family.callback(delta)

    def check_params(self, params: SamplingParams) -> None:
        """Raise SamplingParamsError for settings this engine cannot honour (before anything is
        queued)."""
        self.inputs.check_params(params)

    def _detokenizer(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer | NoDetokenizer:
        if self.tokenizer is None:
            return NoDetokenizer()
        return IncrementalDetokenizer(
            self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop, params.min_tokens
        )

    def abort(self, rid: str) -> None:
        family = self.families.get(rid)
        if family is not None:
            for child in family.children:
                if child in self.states:
                    self._finish(self.states[child], "abort")
            return
        state = self.states.get(rid)
        if state is not None:
            self._finish(state, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._launched is not None

    # ---- the loop body -----------------------------------------------------------------------
    def step(self) -> bool:
        """Schedule and launch one batch, and process the tokens of the batch launched before
        it (overlap) or of this one (no overlap). Returns False when there was nothing to do."""
        self.last_wait_s = 0.0
        previous, self._launched = self._launched, None
        # The previous batch's tokens are processed after this step's launch unless the
        # schedule needs them first.
        after_launch = previous if previous is not None and not previous.blocks_scheduling else None
        if previous is not None and after_launch is None:
            self._process(previous)
        out = self.scheduler.schedule()
        if out is not None:
            try:
                self._launched = self._launch(out)
            except Exception:
                # Step n's tokens were computed before step n+1 failed: stream them first, as
                # without overlap, then let the caller fail what is left.
                if after_launch is not None:
                    self._process(after_launch)
                raise
        if after_launch is not None:
            self._process(after_launch)  # the device runs the batch just launched meanwhile
        if self._launched is not None and not self.overlap:
            launched, self._launched = self._launched, None
            self._process(launched)
        if self.config.debug_checks and not self.has_work():
            self.scheduler.check_integrity()
        return out is not None or previous is not None

    def _launch(self, out: ScheduleOutput) -> _Launched:
        sampled = [out.reqs[i] for i in out.sample_rows]
        requests = [self._sample_request(req) for req in sampled]
        now = time.monotonic()  # before the launch: on a CPU it runs the forward
        step = self.runner.launch(out.batch, out.sample_rows, requests)
        self.scheduler.on_batch_launched(out)
        self.batch_log.on_launch(out)
        for req in out.reqs:
            metrics = self.states[req.rid].metrics
            if metrics.first_scheduled is None:
                metrics.first_scheduled = now
        blocks = any(req.params.penalizes for req in sampled)
        return _Launched(out, step, blocks)

    def _process(self, launched: _Launched) -> None:
        """Wait for a launched batch's tokens, then record, detokenize and stream them."""
        t0 = time.perf_counter()
        sampled = launched.step.result()
        self.last_wait_s += time.perf_counter() - t0
        out = launched.out
        self.scheduler.record_step(out, sampled.seconds)
        next_ids = dict(zip(out.sample_rows, sampled.next_token_ids, strict=True))
        logprobs: dict[int, _TokenLogprobs] = {}
        if sampled.logprobs is not None:
            ranks = sampled.ranks or [0] * len(sampled.logprobs)
            tops = sampled.top or [[]] * len(sampled.logprobs)
            for row, value, rank, top in zip(
                out.sample_rows, sampled.logprobs, ranks, tops, strict=True
            ):
                logprobs[row] = _TokenLogprobs(value, rank, top)
        row_of = {id(req): row for row, req in enumerate(out.reqs)}
        for req in self.scheduler.resolve_tokens(out, next_ids):
            row = row_of[id(req)]
            self._on_token(self.states[req.rid], next_ids[row], logprobs.get(row))

    def _sample_request(self, req: Req) -> SampleRequest:
        st = self.states[req.rid]
        # min_tokens: a request may not stop on a token before it has that many.
        below_min = len(req.output_ids) < req.params.min_tokens
        penalized = req.params.penalizes
        return SampleRequest(
            req.rid,
            req.params,
            req.all_ids if penalized else [],
            sorted(st.stop_ids) if below_min else [],
            len(req.prompt_ids),
        )

    def _on_token(self, state: _ReqState, token: int, logprob: _TokenLogprobs | None) -> None:
        req, params = state.req, state.req.params
        if state.metrics.first_token is None:
            state.metrics.first_token = time.monotonic()
        delta = RequestOutput(request_id=req.rid, token_ids=[token])
        if logprob is not None and params.logprobs:  # other rows' values depend on the batch
            delta.logprobs = [logprob.value]
            delta.logprob_ranks = [logprob.rank]
            if params.top_logprobs:
                delta.top_logprobs = [logprob.top[: params.top_logprobs]]
            state.cumulative_logprob += logprob.value
        state.pending = delta
        if token in state.stop_ids:
            self._finish(state, "stop")
            return
        delta.text = state.detokenizer.add(token)
        if state.detokenizer.stopped:
            self._finish(state, "stop")
        elif req.reaches_length_limit(req.num_known_outputs, self.max_context_len):
            self._finish(state, "length")
        else:
            self._emit(state, delta)

    def _finish(self, state: _ReqState, reason: str, keep_kv: bool = True) -> None:
        req = state.req
        self.scheduler.finish(req, reason, keep_kv)
        self.runner.release_request(req.rid)
        del self.states[req.rid]
        self.finished_total[reason] = self.finished_total.get(reason, 0) + 1
        delta = state.pending or RequestOutput(request_id=req.rid)
        if reason != "stop" or not state.detokenizer.stopped:
            delta.text += state.detokenizer.flush()
        delta.finished = True
        delta.finish_reason = reason
        state.metrics.finished = time.monotonic()
        delta.metrics = state.metrics
        self._emit(state, delta)

    def _emit(self, state: _ReqState, delta: RequestOutput) -> None:
        req = state.req
        delta.num_prompt_tokens = len(req.prompt_ids)
        delta.num_output_tokens = req.num_known_outputs
        delta.cached_tokens = req.cached_tokens
        delta.cumulative_logprob = state.cumulative_logprob
        state.pending = None
        try:
            state.callback(delta)
        except Exception:  # a caller's bug must not stop the engine
            logger.exception("callback of request %s failed", req.rid)

    def shutdown(self) -> None:
        """Release the model runner's resources (its device memory, its tensor-parallel worker
        processes); the engine runs no step afterwards."""
        self.runner.shutdown()

    def broken(self) -> str | None:
        """Why this engine cannot run another step, or None: a tensor-parallel worker died or
        the GPU holds a sticky error (every later step would fail the same way)."""
        workers = self.runner.workers
        if workers is not None and not workers.alive():
            return "a tensor-parallel worker process is gone; the engine must be restarted"
        return self.runner.device_error()

    def fail_all(self, error: str) -> bool:
        """End every request with an error (the loop hit an exception it cannot recover from),
        and empty the prefix cache. False if a request's bookkeeping failed on the way: it still
        got its final output, but its slots may be lost and the engine should not serve again."""
        self._launched = None
        clean = True
        for state in list(self.states.values()):
            state.pending = RequestOutput(request_id=state.req.rid, error=error)
            try:
                self._finish(state, "abort", keep_kv=False)
            except Exception:
                logger.exception("ending request %s failed", state.req.rid)
                clean = False
                self.states.pop(state.req.rid, None)
                # _finish tells the request last, so it was not told: tell it here
                self._emit(
                    state,
                    RequestOutput(state.req.rid, finished=True, finish_reason="abort", error=error),
                )
        if clean:
            # (the failed step's prefill chunks entered the prefix cache at its launch)
            self.scheduler.drop_prefix_cache()
        return clean

    # ---- stats -------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        sched = self.scheduler
        c = sched.counters
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=len(sched.waiting),
            kv_cache_usage=sched.kv_usage(),
            prompt_tokens_total=c.prompt_tokens,
            generation_tokens_total=c.generation_tokens,
            prefix_cache_hit_tokens_total=c.cache_hit_tokens,
            prefix_cache_queried_tokens_total=c.cache_queried_tokens,
            finished_total=dict(self.finished_total),
        )
