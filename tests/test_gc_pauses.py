"""Freezing start-up objects makes a later full collection skip them; long collections are logged."""
from __future__ import annotations

import gc
import logging

from nano_qwen3tts_vllm import gc_pauses


class Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def test_frozen_objects_are_skipped_and_long_pauses_logged(caplog):
    kept = [Node() for _ in range(1000)]
    try:
        gc_pauses.freeze_startup_objects()
        assert gc.get_freeze_count() >= len(kept)
        tracked = {id(o) for o in gc.get_objects()}  # what a full collection walks
        assert not any(id(n) in tracked for n in kept)
        gc_pauses.log_long_pauses(threshold_ms=-1.0)  # log every collection
        gc_pauses.log_long_pauses(threshold_ms=-1.0)  # idempotent
        assert gc.callbacks.count(gc_pauses._log_pause) == 1
        with caplog.at_level(logging.INFO, logger="nano_qwen3tts_vllm.gc_pauses"):
            gc.collect()
        assert any("garbage collection (generation 2)" in r.getMessage() for r in caplog.records)
    finally:
        gc.callbacks.remove(gc_pauses._log_pause)
        gc.unfreeze()
