"""Python's garbage collector in a serving process.

A full (generation 2) collection walks every tracked object: after start-up that is the
model's modules and parameters, the tokenizer, the captured graphs' objects, and all of it is
alive for the life of the engine. `freeze_startup_objects` moves what start-up made out of
the collector's reach (`gc.freeze`, as vLLM and SGLang do after start-up), so a collection in
the middle of serving walks only what serving made. `watch_pauses` logs collections longer
than a threshold, so a stall in the step times can be told from one in the engine.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

PAUSE_WARN_S = 0.05
_start: float | None = None
# What a freeze held is given back at exit, so that the shutdown's collection frees it as usual
# (a no-op when nothing was frozen).
atexit.register(gc.unfreeze)


def freeze_startup_objects() -> None:
    """Collect once, then move every surviving object to the permanent generation."""
    gc.collect()
    gc.freeze()
    watch_pauses()


def watch_pauses() -> None:
    """Log a warning for each collection that stops the process longer than PAUSE_WARN_S
    (installed once per process)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    global _start
    if phase == "start":
        _start = time.perf_counter()
    elif _start is not None:
        paused = time.perf_counter() - _start
        _start = None
        if paused > PAUSE_WARN_S:
            logger.warning(
                "garbage collection (generation %d) paused the process %.0f ms (%d objects "
                "collected)", info.get("generation", -1), 1e3 * paused, info.get("collected", 0),
            )  # fmt: skip
