"""engine.gc_control: start-up objects frozen, long collections logged."""

from __future__ import annotations

import gc
import logging

import pytest

from engine import gc_control


def test_freeze_moves_startup_objects_out_of_collections() -> None:
    keep = [object() for _ in range(10)] + [[i] for i in range(1000)]
    try:
        gc_control.freeze_startup_objects()
        assert gc.get_freeze_count() >= len(keep)
        assert gc_control._on_gc in gc.callbacks
        gc_control.watch_pauses()  # once per process
        assert gc.callbacks.count(gc_control._on_gc) == 1
    finally:
        gc.unfreeze()


def test_a_long_collection_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gc_control, "PAUSE_WARN_S", 0.0)
    gc_control.watch_pauses()
    with caplog.at_level(logging.WARNING, logger="engine.gc_control"):
        gc.collect()
    assert "garbage collection (generation 2) paused the process" in caplog.text
    monkeypatch.setattr(gc_control, "PAUSE_WARN_S", 10.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.gc_control"):
        gc.collect()
    assert "garbage collection" not in caplog.text


def test_the_engine_freezes_after_start_up(tiny_llama: str) -> None:
    from engine.llm import LLM

    gc.unfreeze()
    LLM(tiny_llama, max_total_tokens=256)
    try:
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
