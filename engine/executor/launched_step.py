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

from engine.layers.sampler import SampleOutput
from engine.sampling_params import SamplingParams


@dataclass
class SampleRequest:
    """What sampling needs to know of one request in a step (plain values, no tensors)."""

    rid: str
    params: SamplingParams
    history: list[int]  # prompt + output ids so far; only read with a penalty (`penalizes`)
    suppressed_ids: list[int]  # ids it may not produce this step (EOS below min_tokens)
    prompt_len: int = 0  # history's first ids that are the prompt (the rest: its output)


class StepOutput(NamedTuple):
    next_token_ids: list[int]  # one per sampled row
    logprobs: list[float] | None  # raw logprob of each chosen token, when any row asked
    seconds: float = 0.0  # device time of the step (wall time on a CPU)
    ranks: list[int] | None = None  # with logprobs: each chosen token's rank (1: most likely)
    # With some row's top_logprobs: each row's most likely (token id, logprob), most likely
    # first, as many as the batch's largest top_logprobs.
    top: list[list[tuple[int, float]]] | None = None


class LaunchedStep:
    """A step queued on the device (SGLang's overlap schedule, in its light form).

    Its sampled ids (and logprobs, ranks, top tokens) travel to pinned host memory in a
    non-blocking copy that an event follows; `result()` waits for that event, the step's one
    synchronization. On a CPU the step has run by the time it is launched and `result()` only
    converts.
    """

    def __init__(
        self,
        device: torch.device,
        sampled: SampleOutput | None,
        started: torch.cuda.Event | None,
        t0: float,
    ) -> None:
        self._sampled = None
        if sampled is not None:
            self._sampled = SampleOutput(
                _host(sampled.next_token_ids), *(_to_host(t) for t in sampled[1:])
            )
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
        if self._sampled is None:
            return StepOutput([], None, seconds)
        ids, logprobs, ranks, top_ids, top_logprobs = (
            None if t is None else t.tolist() for t in self._sampled
        )
        top = None
        if top_ids is not None and top_logprobs is not None:
            top = [list(zip(i, p, strict=True)) for i, p in zip(top_ids, top_logprobs, strict=True)]
        return StepOutput(ids or [], logprobs, seconds, ranks, top)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _host(t)


def _host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host: a non-blocking copy into pinned memory from a GPU."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
