"""What the engine hands back to callers: per-step deltas and whole results."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """When the engine saw a request pass each stage, in `time.monotonic()` seconds (one clock
    for every process of the machine), as vLLM's RequestMetrics: `arrival` (the engine took
    it), `first_scheduled` (its first prefill batch was scheduled), `first_token` (the engine
    had its first output token), `finished`. A stage it never reached is None."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first scheduled batch."""
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def prefill_time(self) -> float | None:
        """Seconds from the first scheduled batch to the first token (every prefill chunk)."""
        if self.first_scheduled is None or self.first_token is None:
            return None
        return self.first_token - self.first_scheduled


@dataclass
class RequestOutput:
    """One streamed step of a request (a delta), or the final result when `finished`.

    `text`, `token_ids` and the logprob lists hold only what is new since the previous delta;
    with `logprobs` asked, `logprobs[i]` and `logprob_ranks[i]` are token i's raw
    log-probability and rank (1: most likely), and with `top_logprobs` N, `top_logprobs[i]` the
    N most likely (token id, logprob) pairs at its step, most likely first.
    Exactly one delta per request has `finished=True`; it carries `finish_reason`
    ("stop" | "length" | "abort") and, when the request failed, `error`.

    A request of `n` sequences (`SamplingParams.n`) streams the deltas of all of them, each
    with its sequence's `index` (0 to n-1) and that sequence's own counts. A sequence's last
    delta carries its `finish_reason`; the last of these to come also has `finished=True` (and
    the request's `error`, if any sequence failed).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logprob_ranks: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, not the delta
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cumulative_logprob: float = 0.0
    error: str | None = None
    metrics: RequestMetrics | None = None  # on the finished delta only
    index: int = 0  # the sequence, with n > 1


@dataclass
class CompletionOutput:
    """A whole finished sequence, as returned by `LLM.generate` (`index`: which of its
    request's `n`)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None
    cumulative_logprob: float = 0.0
    cached_tokens: int = 0
    logprob_ranks: list[int] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    index: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of engine counters, read by the metrics exporter off the hot loop."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_hit_tokens_total: int
    prefix_cache_queried_tokens_total: int
    finished_total: dict[str, int]
