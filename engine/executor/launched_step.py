"""What the engine core hands the runner about a step's sampling, and what it gets back.

`SampleRequest` describes one sampled request with plain values; `LaunchedStep` is a step queued
on the device whose sampled ids the host fetches later (the overlap schedule's one
synchronization per step); `StepOutput` is what it yields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    """What sampling needs to know of one request in a step (plain values, no tensors)."""

    rid: str
    params: SamplingParams
    history: list[int]  # prompt + output ids so far; only read with repetition_penalty
    suppressed_ids: list[int]  # ids it may not produce this step (EOS below min_tokens)


class StepOutput(NamedTuple):
    next_token_ids: list[int]  # one per sampled row
    logprobs: list[float] | None  # raw logprob of each chosen token, when any row asked
    seconds: float = 0.0  # device time of the step (wall time on a CPU)


class LaunchedStep:
    """A step queued on the device (SGLang's overlap schedule, in its light form).

    Its sampled ids (and logprobs) travel to pinned host memory in a non-blocking copy that an
    event follows; `result()` waits for that event, the step's one synchronization. On a CPU
    the step has run by the time it is launched and `result()` only converts.
    """

    def __init__(
        self,
        device: torch.device,
        next_ids: torch.Tensor | None,
        logprobs: torch.Tensor | None,
        started: torch.cuda.Event | None,
        t0: float,
    ) -> None:
        self._ids = _to_host(next_ids)
        self._logprobs = _to_host(logprobs)
        self._started = started
        self._done: torch.cuda.Event | None = None
        if started is not None:
            self._done = torch.cuda.Event(enable_timing=True)
            self._done.record(torch.cuda.current_stream(device))
        self._wall_s = time.perf_counter() - t0

    def result(self) -> StepOutput:
        """The sampled ids, once the device has produced and copied them."""
        seconds = self._wall_s
        if self._done is not None and self._started is not None:
            self._done.synchronize()
            seconds = self._started.elapsed_time(self._done) / 1e3
        ids = [] if self._ids is None else self._ids.tolist()
        logprobs = None if self._logprobs is None else self._logprobs.tolist()
        return StepOutput(ids, logprobs, seconds)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` on the host: a non-blocking copy into pinned memory from a GPU."""
    if t is None or t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
