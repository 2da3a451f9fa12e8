"""POST /v1/audio/speech: validate everything first, then stream (raw bytes or SSE) or send the whole clip.

Once a 200 has been sent nothing can be validated any more, so the request is built (all of
build_request's checks) and its first chunk awaited before the response starts.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..models.codec_decoder import StreamsBusyError
from .audio_formats import CONTENT_TYPES, encode, pcm16_bytes, wav_header
from .errors import APIError, param_for
from .protocol import RESPONSE_FORMATS, STREAMABLE_FORMATS, TASK_TYPES, SpeechRequest
from .ref_audio import load_ref_audio

if TYPE_CHECKING:
    from .app import ServerState

logger = logging.getLogger(__name__)


@dataclass
class Plan:
    """How the audio leaves: `stream` (raw bytes as produced), `sse` (OpenAI speech events) or `whole`."""
    fmt: str
    mode: str


def plan_response(body: SpeechRequest) -> Plan:
    if body.speed is not None and body.speed != 1.0:
        raise APIError(400, f"speed {body.speed} is not supported: Qwen3-TTS speaks at its own pace; "
                            "leave speed out or set it to 1.0", "speed", "unsupported_value")
    if body.stream_format not in (None, "audio", "sse"):
        raise APIError(400, f"stream_format must be 'audio' or 'sse', got {body.stream_format!r}", "stream_format")
    sse = body.stream_format == "sse"
    fmt = body.response_format or ("pcm" if sse else "mp3")
    if fmt not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format {fmt!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}",
                       "response_format", "unsupported_value")
    if sse:
        if body.stream is False:
            raise APIError(400, "stream_format 'sse' streams; it cannot be combined with stream=false", "stream")
        if fmt != "pcm":
            raise APIError(400, f"with stream_format 'sse' the audio deltas are base64 16-bit PCM; set "
                                f"response_format to 'pcm' (got {fmt!r})", "response_format", "unsupported_value")
        return Plan(fmt, "sse")
    return Plan(fmt, "stream" if fmt in STREAMABLE_FORMATS and body.stream is not False else "whole")


def resolve_task(body: SpeechRequest, model_type: str) -> str:
    own = TASK_TYPES[model_type]
    if body.task_type is None:
        return own
    wanted = {t.lower(): t for t in TASK_TYPES.values()}.get(body.task_type.lower())
    if wanted is None:
        raise APIError(400, f"task_type must be one of {', '.join(TASK_TYPES.values())}, got {body.task_type!r}",
                       "task_type")
    if wanted != own:
        raise APIError(400, f"task_type {wanted} needs a {wanted} model, but this server serves a {own} model; "
                            f"leave task_type out or send it to a {wanted} server", "task_type", "task_type_mismatch")
    return own


def build(state: "ServerState", body: SpeechRequest, task: str):
    """Blocking (tokenizing, reference audio, speaker encoder): runs on the server's builder thread."""
    kw = dict(task_type=task, text=body.input, language=body.language, instruct=body.instructions,
              non_streaming_mode=body.non_streaming_mode, **body.generation_kwargs())
    if task == "CustomVoice":
        kw["speaker"] = body.voice
    elif task == "Base":
        if body.ref_audio:
            kw.update(ref_audio=load_ref_audio(body.ref_audio, state.settings), ref_text=body.ref_text,
                      x_vector_only_mode=body.x_vector_only_mode)
        else:
            voice = state.voices.get(body.voice or "")
            if voice is None:
                raise APIError(400, f"voice {body.voice!r} is not a registered voice: a Base model clones a voice, so "
                                    "send ref_audio (and ref_text), or register one with POST /v1/audio/voices",
                               "voice", "voice_not_found")
            kw["voice_clone_prompt"] = [voice.prompt]
    try:
        return state.tts.build_request(**kw)
    except ValueError as e:
        raise APIError(400, str(e), param_for(str(e))) from e


def engine_failure(state: "ServerState", e: Exception) -> APIError:
    if isinstance(e, ValueError):
        return APIError(400, str(e), param_for(str(e)))
    if isinstance(e, StreamsBusyError):  # every streaming decoder slot is taken: like a full queue
        return APIError(429, f"the server is full: {e}", None, "streams_busy", {"Retry-After": "1"})
    if not state.tts.stats().get("alive", 0):
        return APIError(503, f"the engine is not running ({e}); retry later", None, "engine_unavailable")
    return APIError(500, f"generation failed: {e}", None, "generation_failed")


class SpeechJob:
    """One request's audio stream plus its accounting (queue slot, metrics); close() exactly once."""

    def __init__(self, state: "ServerState", request, arrived: float):
        self.state, self.request, self.arrived = state, request, arrived
        self.gen = state.tts.astream_request(request, state.settings.chunk_size, state.settings.first_chunk_size)
        self.samples = 0
        self.first_at: float | None = None
        self.done = False
        self.outcome = "disconnected"  # unless it completes or fails
        self._closed = False

    @property
    def frames(self) -> int:
        return self.samples // self.state.upsample

    def usage(self) -> dict:
        n_in = len(self.request.prompt)
        return {"input_tokens": n_in, "output_tokens": self.frames, "total_tokens": n_in + self.frames}

    async def next_chunk(self) -> np.ndarray | None:
        try:
            chunk = await self.gen.__anext__()
        except StopAsyncIteration:
            self.done, self.outcome = True, "completed"
            return None
        if self.first_at is None:
            self.first_at = time.perf_counter()
            self.state.metrics.ttfa.observe(self.first_at - self.arrived)
        self.samples += chunk.shape[0]
        return chunk

    async def collect(self, first: np.ndarray | None) -> np.ndarray:
        chunks = [] if first is None else [first]
        while (chunk := await self.next_chunk()) is not None:
            chunks.append(chunk)
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)

    async def close(self, error: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        self.state.in_flight -= 1
        m = self.state.metrics
        m.speech_outcomes.labels("error" if error else self.outcome).inc()
        if self.done and self.samples:
            audio_s = self.samples / self.state.sample_rate
            m.audio_seconds.inc(audio_s)
            m.rtf.observe((time.perf_counter() - self.arrived) / audio_s)
        try:
            await self.gen.aclose()  # aborts the engine request (frees its KV blocks) if it is still running
        except Exception:  # noqa: BLE001
            logger.exception("closing the audio stream of %s failed", self.request)


class AudioStreamResponse(StreamingResponse):
    """Closes the body and its job whatever ends the response, so a client that left aborts its request
    (Starlette cancels the body on a disconnect but does not close it)."""

    def __init__(self, job: SpeechJob, body: AsyncIterator[bytes], **kw):
        super().__init__(body, **kw)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        first = True

        async def stamped(message) -> None:
            nonlocal first
            await send(message)
            if first and message["type"] == "http.response.body" and message.get("body"):
                first = False
                self.job.state.metrics.ttfb.observe(time.perf_counter() - self.job.arrived)
        try:
            await super().__call__(scope, receive, stamped)
        finally:
            await self.body_iterator.aclose()
            await self.job.close()  # no-op unless the body never started


async def _raw_body(job: SpeechJob, first: np.ndarray | None, fmt: str) -> AsyncIterator[bytes]:
    failed = False
    try:
        if fmt == "wav":
            yield wav_header(job.state.sample_rate)
        chunk = first
        while chunk is not None:
            yield pcm16_bytes(chunk)
            chunk = await job.next_chunk()
    except Exception:
        failed = True
        logger.exception("audio stream failed after its response started; closing the connection")
        raise  # the client sees a broken transfer, not a clean end of a short clip
    finally:
        await job.close(error=failed)


def _event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _sse_body(job: SpeechJob, first: np.ndarray | None) -> AsyncIterator[bytes]:
    failed = False
    try:
        chunk = first
        while chunk is not None:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(pcm16_bytes(chunk)).decode()})
            chunk = await job.next_chunk()
        yield _event({"type": "speech.audio.done", "usage": job.usage()})
    except Exception as e:  # noqa: BLE001 - reported in the stream, which is already 200
        failed = True
        logger.exception("SSE audio stream failed after its response started")
        yield _event({"type": "error", "error": {"message": f"generation failed: {e}", "type": "server_error",
                                                 "param": None, "code": "generation_failed"}})
    finally:
        await job.close(error=failed)


class _ClientGone(Exception):
    pass


async def _unless_disconnected(http: Request, aw):
    """Await `aw`, polling for the client leaving meanwhile; if it leaves, cancel `aw` (which aborts the
    engine request) and raise _ClientGone. Covers waiting in a full engine and whole-clip generation."""
    task = asyncio.ensure_future(aw)
    try:
        while not (await asyncio.wait({task}, timeout=0.25))[0]:
            if await http.is_disconnected():
                raise _ClientGone
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _whole(job: SpeechJob, audio: np.ndarray, fmt: str, headers: dict) -> Response:
    data = encode(audio, job.state.sample_rate, fmt)
    usage = job.usage()
    headers.update({"X-Input-Tokens": str(usage["input_tokens"]), "X-Output-Tokens": str(usage["output_tokens"])})
    return Response(data, media_type=CONTENT_TYPES[fmt], headers=headers)


async def create_speech(state: "ServerState", body: SpeechRequest, http: Request) -> Response:
    arrived = getattr(http.state, "arrived", None) or time.perf_counter()  # RequestCounter's stamp
    state.check_model(body.model)
    plan = plan_response(body)
    task = resolve_task(body, state.tts.model_cfg.model_type)
    if len(body.input) > state.settings.max_input_chars:
        raise APIError(400, f"input has {len(body.input)} characters; the limit is {state.settings.max_input_chars}: "
                            "split the text into several requests", "input", "string_above_max_length")
    state.reserve_slot()  # 429 when full
    job = None
    try:
        request = await asyncio.get_running_loop().run_in_executor(state.builder, build, state, body, task)
        job = SpeechJob(state, request, arrived)
        try:
            first = await _unless_disconnected(http, job.next_chunk())
            audio = await _unless_disconnected(http, job.collect(first)) if plan.mode == "whole" else None
        except _ClientGone:
            await job.close()
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except Exception as e:
            raise engine_failure(state, e) from e
        headers = {"X-Sample-Rate": str(state.sample_rate), "Cache-Control": "no-cache"}
        if plan.mode == "whole":
            response = await asyncio.to_thread(_whole, job, audio, plan.fmt, headers)
            await job.close()
            return response
        headers["X-Accel-Buffering"] = "no"  # proxies must not hold the chunks back
        if plan.mode == "sse":
            return AudioStreamResponse(job, _sse_body(job, first), media_type="text/event-stream", headers=headers)
        return AudioStreamResponse(job, _raw_body(job, first, plan.fmt), media_type=CONTENT_TYPES[plan.fmt],
                                   headers=headers)
    except BaseException:
        if job is None:
            state.in_flight -= 1
        else:
            await job.close(error=True)
        raise
