"""Runs an LLMEngine on a background thread so many threads and coroutines can share it.

Callers submit requests and read frames from a per-request stream; the thread batches whatever
is in flight at each step. An exception in a step fails the requests in flight, not the thread.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine, StepOutput
from .sequence import Prompt

logger = logging.getLogger(__name__)
FRAMES_PER_SECOND = 12.5


class EngineError(RuntimeError):
    """The engine failed while running this request."""


class RequestStream:
    """Frames of one request, in order, as the engine produces them."""

    def __init__(self, request_id: str, engine: "EngineThread"):
        self.request_id = request_id
        self._engine = engine
        self._queue: queue.Queue = queue.Queue()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None = None
        self.finish_reason: str | None = None

    def _put(self, item) -> None:
        if self._async is not None:
            loop, q = self._async
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop was closed: nobody reads this stream any more
                logger.debug("dropping an output of %s: its event loop is closed", self.request_id)
        else:
            self._queue.put(item)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver to an asyncio queue on `loop` instead (call before submitting)."""
        self._async = (loop, asyncio.Queue())

    def _handle(self, item) -> list[int] | None:
        if isinstance(item, BaseException):
            raise item
        out: StepOutput = item
        if out.finished:
            self.finish_reason = out.finish_reason
            if out.finish_reason == "abort":
                raise EngineError(f"request {self.request_id} was aborted")
        return out.frame

    def __iter__(self) -> Iterator[list[int]]:
        """Yields each frame (16 codes) until the request finishes."""
        while self.finish_reason is None:
            frame = self._handle(self._queue.get())
            if frame is not None:
                yield frame

    async def aiter(self):
        loop, q = self._async
        while self.finish_reason is None:
            frame = self._handle(await q.get())
            if frame is not None:
                yield frame

    def abort(self) -> None:
        self._engine.abort(self.request_id)


@dataclass
class StepStats:
    """Engine activity since the last report, logged every `every_s` seconds while busy."""
    every_s: float = 10.0
    since: float = field(default_factory=time.monotonic)
    steps: int = 0
    frames: int = 0
    busy_s: float = 0.0

    def record(self, seconds: float, outputs: list[StepOutput]) -> None:
        self.steps += 1
        self.busy_s += seconds
        self.frames += sum(out.frame is not None for out in outputs)
        wall = time.monotonic() - self.since
        if wall >= self.every_s:
            logger.info("engine: %.1f steps/s, %.0f frames/s (%.1fx real time), %.2f ms per step, busy %.0f%%",
                        self.steps / wall, self.frames / wall, self.frames / wall / FRAMES_PER_SECOND,
                        1000 * self.busy_s / self.steps, 100 * self.busy_s / wall)
            self.since, self.steps, self.frames, self.busy_s = time.monotonic(), 0, 0, 0.0


def _put_all(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


class EngineThread:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._stopped = False
        self.stats = StepStats()
        self._thread = threading.Thread(target=self._loop, name="nano-qwen3tts-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Validate against the engine's capacity, then queue. Raises ValueError before queueing."""
        if self._stopped:
            raise RuntimeError("the engine has been shut down")
        self.engine.check_fits(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(request_id, self)
        if loop is not None:
            stream.bind_loop(loop)
        self._commands.put(("add", stream, prompt, params, time.monotonic()))
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped and self.engine.is_alive()

    def shutdown(self) -> None:
        self._stopped = True
        self._commands.put(("stop",))
        self._thread.join(timeout=30)
        self.engine.shutdown()

    def _apply(self, cmd) -> bool:
        if cmd[0] == "stop":
            return False
        if cmd[0] == "add":
            _, stream, prompt, params, arrival = cmd
            try:
                self.engine.add_request(prompt, params, stream.request_id, arrival)
                self._streams[stream.request_id] = stream
            except Exception as e:  # noqa: BLE001 - delivered to the caller
                stream._put(e)
        elif cmd[0] == "abort":
            stream = self._streams.pop(cmd[1], None)
            if self.engine.abort(cmd[1]) and stream is not None:
                stream._put(StepOutput(cmd[1], None, True, "abort"))
        return True

    def _loop(self) -> None:
        running = True
        while running:
            try:
                block = not self.engine.has_unfinished()
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                running = self._apply(cmd)
                continue
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                t0 = time.monotonic()
                outputs = self.engine.step()
                self.stats.record(time.monotonic() - t0, outputs)
            except Exception as e:  # noqa: BLE001
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_all(EngineError(f"engine step failed: {e!r}"))
                self._recover()
                continue
            self._deliver(outputs)
        self._fail_all(EngineError("the engine was shut down"))

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """One wake-up per event loop per step, not one per stream: with many streams on one server
        loop, per-item call_soon_threadsafe calls cost the engine thread GIL time every step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if stream._async is None:
                stream._queue.put(out)
            else:
                loop, q = stream._async
                by_loop.setdefault(loop, []).append((q, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop was closed: its streams have no reader any more
                logger.debug("dropping %d outputs for a closed event loop", len(items))

    def _recover(self) -> None:
        try:
            self.engine.recover()
        except Exception:  # noqa: BLE001
            logger.exception("could not recover the engine; it stays unhealthy")

    def _fail_all(self, err: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream._put(err)
        self._streams.clear()
