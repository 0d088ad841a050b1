"""Prometheus metrics for the Triton model, published through `pb_utils.MetricFamily`.

`MetricsExporter` owns one thread. It polls `AsyncEngine.stats()` for the gauges and the counters
(counters are incremented by the difference from the previous snapshot) and takes per-request
latencies from a queue, so neither the engine loop nor the response thread waits on Triton's
metric calls. `RequestTimer` turns one request's deltas into those latencies. `pb_utils` is
passed in: this module imports no Triton code and runs in unit tests with a stand-in.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import EngineStats, RequestMetrics

TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
ITL_BUCKETS = [0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.1, 0.3, 0.5, 1.0, 1.5, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0]
FINISH_REASONS = ("stop", "length", "abort")
# (RequestTiming field, metric name, help text): the engine's own stages of a request
STAGES = (
    (
        "queue_time",
        "llm_request_queue_time_seconds",
        "Engine: arrival to the first scheduled batch.",
    ),
    (
        "prefill_time",
        "llm_request_prefill_time_seconds",
        "Engine: first scheduled batch to the first token.",
    ),
)

# stats field -> (metric name, help text)
COUNTERS = {
    "prompt_tokens_total": ("llm_prompt_tokens_total", "Prompt tokens processed."),
    "generation_tokens_total": ("llm_generation_tokens_total", "Tokens generated."),
    "prefix_cache_hit_tokens_total": (
        "llm_prefix_cache_hit_tokens_total",
        "Prompt tokens served from the prefix cache.",
    ),
    "prefix_cache_queried_tokens_total": (
        "llm_prefix_cache_queried_tokens_total",
        "Prompt tokens looked up in the prefix cache.",
    ),
}
GAUGES = {
    "num_running": ("llm_num_requests_running", "Requests in the running batch."),
    "num_waiting": ("llm_num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage": ("llm_kv_cache_usage_ratio", "Fraction of KV cache slots in use (0 to 1)."),
}


@dataclass
class RequestTiming:
    """Latencies of one finished request, in seconds."""

    ttft: float | None  # None when no token was produced
    inter_token: list[float] = field(default_factory=list)
    e2e: float = 0.0
    queue_time: float | None = None  # the engine's RequestMetrics, when it sent them
    prefill_time: float | None = None


@dataclass
class RequestTimer:
    """Times one request from its arrival, delta by delta (monotonic clock).

    A delta of n tokens after the first counts as n gaps of equal length: the engine may hand
    several tokens over at once, and each of them waited its share. The sequences of an n > 1
    request (`index`) are timed apart: the first token is the first of any, gaps are each
    sequence's own.
    """

    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: dict[int, float] = field(default_factory=dict)  # by sequence
    gaps: list[float] = field(default_factory=list)

    def on_tokens(self, n: int, now: float | None = None, index: int = 0) -> None:
        """`n` new output tokens of sequence `index` arrived (call only when n > 0)."""
        now = time.monotonic() if now is None else now
        if self.first_token_at is None:
            self.first_token_at = now
        last = self.last_token_at.get(index)
        if last is not None:
            self.gaps.extend([(now - last) / n] * n)
        self.last_token_at[index] = now

    def timing(
        self, now: float | None = None, engine: RequestMetrics | None = None
    ) -> RequestTiming:
        """The finished request's latencies; `engine`: the engine's stages of it."""
        now = time.monotonic() if now is None else now
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        return RequestTiming(
            ttft=ttft,
            inter_token=self.gaps,
            e2e=now - self.arrival,
            queue_time=engine.queue_time if engine else None,
            prefill_time=engine.prefill_time if engine else None,
        )


class MetricsExporter:
    """Publishes engine stats and request latencies as `llm_*` metrics, from its own thread."""

    def __init__(
        self,
        pb_utils: Any,
        labels: dict[str, str],
        stats_fn: Callable[[], EngineStats],
        interval_s: float = 0.5,
    ) -> None:
        self._stats_fn = stats_fn
        self._interval_s = interval_s
        self._labels = dict(labels)
        family = pb_utils.MetricFamily
        self._families: list[Any] = []  # keep families alive as long as their metrics

        def make(name: str, help_text: str, kind: Any) -> Any:
            fam = family(name=name, description=help_text, kind=kind)
            self._families.append(fam)
            return fam

        self._ttft = make(
            "llm_time_to_first_token_seconds", "Time to first token.", family.HISTOGRAM
        ).Metric(labels=self._labels, buckets=TTFT_BUCKETS)
        self._itl = make(
            "llm_inter_token_latency_seconds", "Time between output tokens.", family.HISTOGRAM
        ).Metric(labels=self._labels, buckets=ITL_BUCKETS)
        self._e2e = make(
            "llm_e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            family.HISTOGRAM,
        ).Metric(labels=self._labels, buckets=E2E_BUCKETS)
        self._stages = {
            key: make(name, text, family.HISTOGRAM).Metric(
                labels=self._labels, buckets=TTFT_BUCKETS
            )
            for key, name, text in STAGES
        }
        self._counters = {
            key: make(name, text, family.COUNTER).Metric(labels=self._labels)
            for key, (name, text) in COUNTERS.items()
        }
        self._gauges = {
            key: make(name, text, family.GAUGE).Metric(labels=self._labels)
            for key, (name, text) in GAUGES.items()
        }
        self._finished_family = make(
            "llm_request_finished_total", "Finished requests by finish reason.", family.COUNTER
        )
        self._finished: dict[str, Any] = {}
        for reason in FINISH_REASONS:
            self._finished_metric(reason)
        self._last: EngineStats | None = None
        self._queue: queue.SimpleQueue[RequestTiming | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="llm-metrics", daemon=True)
        self._thread.start()

    def observe_request(self, timing: RequestTiming) -> None:
        """Record a finished request's latencies (cheap: queues them for the metrics thread)."""
        self._queue.put(timing)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        # NOTE: the engine's counters and gauges go out every interval whatever the request
        # traffic: waiting for a quiet interval froze them while requests kept finishing.
        next_stats = time.monotonic() + self._interval_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_stats - time.monotonic()))
            except queue.Empty:
                pass
            else:
                if item is None:
                    self._publish_stats()
                    return
                self._publish_timing(item)
            if time.monotonic() >= next_stats:
                self._publish_stats()
                next_stats = time.monotonic() + self._interval_s

    def _publish_timing(self, timing: RequestTiming) -> None:
        if timing.ttft is not None:
            self._ttft.observe(timing.ttft)
        for gap in timing.inter_token:
            self._itl.observe(gap)
        self._e2e.observe(timing.e2e)
        for key, metric in self._stages.items():
            seconds = getattr(timing, key)
            if seconds is not None:
                metric.observe(seconds)

    def _publish_stats(self) -> None:
        try:
            stats = self._stats_fn()
        except Exception:  # the engine may be shutting down
            return
        last = self._last
        for key, metric in self._counters.items():
            delta = getattr(stats, key) - (getattr(last, key) if last else 0)
            if delta > 0:
                metric.increment(delta)
        for reason, count in stats.finished_total.items():
            delta = count - (last.finished_total.get(reason, 0) if last else 0)
            if delta > 0:
                self._finished_metric(reason).increment(delta)
        for key, metric in self._gauges.items():
            metric.set(float(getattr(stats, key)))
        self._last = stats

    def _finished_metric(self, reason: str) -> Any:
        if reason not in self._finished:
            labels = {**self._labels, "reason": reason}
            self._finished[reason] = self._finished_family.Metric(labels=labels)
        return self._finished[reason]
