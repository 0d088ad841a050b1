"""One log line per prefill batch and per `decode_log_interval` decode steps, as SGLang's
scheduler logs them: what each batch held, and the generation rate between decode lines.

    prefill batch: 4 requests (3 new), 2048 tokens, 0 cached; running 12, waiting 5, KV 4.1%;
        budget 2048 (fit 24.8 ms + 4.1 us/token)
    decode: 16 running, 1850.2 tok/s, 8.64 ms a step over 40 steps; waiting 0, KV 2.3%

While requests decode, a prefill line also shows the scheduler's prefill budget for the next
step and the line it fits to the recent prefill steps (scheduler.step_cost), or "one size" while
the steps seen are too alike to split fixed and per-token cost.

The rate and the time a step take the wall time since the last decode line (prefill steps in
between included); a pause of over IDLE_S seconds with nothing launched starts the count again.

The lines go to the `engine.batch_log` logger at INFO (`python -m engine.serve` and the engine's
own process show INFO). Plain ints from the scheduler: no tensors, no device synchronization.
"""

from __future__ import annotations

import logging
import time

from engine.scheduler.batch import ForwardMode
from engine.scheduler.scheduler import ScheduleOutput, Scheduler

logger = logging.getLogger(__name__)
IDLE_S = 1.0


class BatchLog:
    def __init__(self, scheduler: Scheduler, decode_interval: int) -> None:
        self.scheduler = scheduler
        self.decode_interval = decode_interval  # 0: no lines
        self._decode_steps = 0
        self._since = self._last = time.monotonic()
        self._generated = scheduler.counters.generation_tokens

    def on_launch(self, out: ScheduleOutput) -> None:
        if self.decode_interval <= 0 or not logger.isEnabledFor(logging.INFO):
            return
        now = time.monotonic()
        if now - self._last > IDLE_S:  # the engine was idle: count from here
            self._decode_steps = 0
            self._since, self._generated = now, self.scheduler.counters.generation_tokens
        self._last = now
        if out.batch.mode == ForwardMode.EXTEND:
            self._prefill(out)
        else:
            self._decode_steps += 1
            if self._decode_steps % self.decode_interval == 0:
                self._decode(out)

    def _prefill(self, out: ScheduleOutput) -> None:
        sched, entries = self.scheduler, out.batch.entries
        new = sum(e.prefix_len == 0 or e.prefix_slots is not None for e in entries)
        cached = sum(len(e.prefix_slots or ()) for e in entries)
        logger.info(
            "prefill batch: %d requests (%d new), %d tokens, %d cached; running %d, waiting %d, "
            "KV %.1f%%%s",
            len(entries), new, out.batch.num_tokens, cached, sched.num_running,
            len(sched.waiting), 100 * sched.kv_usage(), _budget(sched),
        )  # fmt: skip

    def _decode(self, out: ScheduleOutput) -> None:
        sched, now = self.scheduler, time.monotonic()
        generated = sched.counters.generation_tokens
        seconds = max(now - self._since, 1e-9)
        logger.info(
            "decode: %d running, %.1f tok/s, %.2f ms a step over %d steps; waiting %d, KV %.1f%%",
            out.batch.batch_size, (generated - self._generated) / seconds,
            1e3 * seconds / self.decode_interval, self.decode_interval, len(sched.waiting),
            100 * sched.kv_usage(),
        )  # fmt: skip
        self._since, self._generated = now, generated


def _budget(sched: Scheduler) -> str:
    if not sched.running:
        return ""
    line = sched.prefill_cost_fit()
    fit = "one size"
    if line is not None:
        fit = f"fit {1e3 * line[0]:.1f} ms + {1e6 * line[1]:.1f} us/token"
    return f"; budget {sched.prefill_budget()} ({fit})"
