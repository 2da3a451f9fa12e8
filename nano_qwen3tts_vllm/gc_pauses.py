"""Python garbage-collector pauses, which stop every thread of a process (the engine's, the event loop).

After start-up a serving process holds hundreds of thousands of long-lived objects (modules, the tokenizer,
model wrappers): a full collection walks them all, 182 ms for the tiny-model server's main process on the CI
machine. Serving creates enough surviving objects (a frame is a list of 16 codes) to trigger one every few
thousand frames, stalling every stream at once. As vLLM does, the serving processes (serve.py, the workers)
freeze their start-up objects (move them out of the collector's view) once loading is done, and log collections
that still take long. The Python API leaves the caller's process as it is.
"""
from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

_started: dict[int, float] = {}
_threshold_ms = 20.0


def freeze_startup_objects() -> None:
    """Collect once, then freeze what survives: later full collections only walk objects made since."""
    gc.collect()
    gc.freeze()
    logger.debug("froze %d start-up objects", gc.get_freeze_count())


def log_long_pauses(threshold_ms: float = 20.0) -> None:
    """Log (at INFO) every collection of this process that takes longer than threshold_ms. Idempotent."""
    global _threshold_ms
    _threshold_ms = threshold_ms
    if _log_pause not in gc.callbacks:
        gc.callbacks.append(_log_pause)


def _log_pause(phase: str, info: dict) -> None:
    gen = info["generation"]
    if phase == "start":
        _started[gen] = time.perf_counter()
        return
    ms = (time.perf_counter() - _started.pop(gen, time.perf_counter())) * 1000
    if ms > _threshold_ms:
        logger.info("garbage collection (generation %d) paused the process for %.1f ms", gen, ms)

