"""The FastAPI app: OpenAI-compatible speech, models and voices routes, health and Prometheus metrics."""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

from fastapi import APIRouter, Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .errors import APIError, error_response, install_error_handlers, param_for
from .metrics import Metrics, RequestCounter
from .protocol import SpeechRequest
from .ref_audio import decode_ref_audio
from .settings import ServerSettings
from .speech import create_speech
from .voices import VoiceStore, check_name

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    tts: object  # Qwen3TTSInterface (or anything with its server-facing methods)
    settings: ServerSettings
    voices: VoiceStore
    sample_rate: int
    upsample: int  # audio samples per frame
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0
    # one thread: tokenizing and the speaker encoder are not made for concurrent callers
    builder: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="nano-qwen3tts-build"))
    metrics: Metrics = field(init=False)
    max_num_seqs: int = field(init=False)

    def __post_init__(self):
        self.metrics = Metrics(self.tts.stats, lambda: self.in_flight)
        self.max_num_seqs = int(self.tts.stats().get("max_num_seqs", 64))

    @property
    def max_queue(self) -> int:
        return self.settings.max_queue or 4 * self.max_num_seqs

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.settings.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{', '.join(self.settings.served_model_names)} (see GET /v1/models)",
                           "model", "model_not_found")

    def reserve_slot(self) -> None:
        """Take a queue slot or answer 429 at once; the caller gives it back (in_flight -= 1)."""
        stats = self.tts.stats()
        if not stats.get("alive", 0):  # a dead engine thread would never answer: fail fast instead
            raise APIError(503, "the engine is not running; retry later", None, "engine_unavailable")
        depth = max(self.in_flight, int(stats.get("running", 0) + stats.get("waiting", 0)))
        if depth >= self.max_queue:
            raise APIError(429, f"the server is full ({depth} requests in flight, --max-queue is {self.max_queue}); "
                                "retry shortly", None, "queue_full", {"Retry-After": "1"})
        self.in_flight += 1


async def _require_api_key(request: Request) -> None:
    key = request.app.state.server.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", None,
                       "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _codec_facts(tts) -> tuple[int, int]:
    st = getattr(tts, "speech_tokenizer", None)
    if st is None:
        return 24000, 1920
    return int(st.get_output_sample_rate()), int(st.get_decode_upsample_rate())


def create_app(tts, settings: ServerSettings | None = None, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """The HTTP app around a loaded Qwen3TTSInterface. The caller owns `tts`; pass on_shutdown=tts.close to
    close it when the server stops (uvicorn re-raises SIGTERM once it has stopped, so code after it may not run)."""
    settings = settings or ServerSettings()
    sample_rate, upsample = _codec_facts(tts)
    voices = VoiceStore(settings.voices_dir)
    if voices.list() and tts.model_cfg.model_type != "base":
        logger.warning("%d registered voices in %s are unusable: the model is %s, not base",
                       len(voices.list()), settings.voices_dir, tts.model_cfg.model_type)
    state = ServerState(tts, settings, voices, sample_rate, upsample)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.builder.shutdown(wait=False, cancel_futures=True)
        if on_shutdown is not None:
            logger.info("closing the engine")
            await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="nano-qwen3tts-vllm", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(RequestCounter, metrics=state.metrics)

    @app.get("/health")
    async def health(request: Request):
        if not _state(request).tts.stats().get("alive", 0):
            return error_response(503, "the engine is not running", None, "engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_require_api_key)])

    @v1.get("/models")
    async def list_models(request: Request):
        s = _state(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": s.created,
                                            "owned_by": "nano-qwen3tts-vllm"}
                                           for name in s.settings.served_model_names]}

    @v1.post("/audio/speech")
    async def speech(body: SpeechRequest, request: Request):
        return await create_speech(_state(request), body, request)

    @v1.get("/audio/voices")
    async def list_voices(request: Request):
        s = _state(request)
        speakers = s.tts.get_supported_speakers() or []
        uploaded = [v.info() for v in s.voices.list()] if s.tts.model_cfg.model_type == "base" else []
        return {"object": "list", "voices": speakers + [v["name"] for v in uploaded], "speakers": speakers,
                "uploaded_voices": uploaded}

    @v1.post("/audio/voices")
    async def register_voice(request: Request, name: str = Form(...), audio: UploadFile = File(...),
                             ref_text: str | None = Form(None), x_vector_only_mode: bool | None = Form(None)):
        s = _state(request)
        if s.tts.model_cfg.model_type != "base":
            raise APIError(400, f"voices can be registered only on a Base (voice clone) model; this server's model "
                                f"is {s.tts.model_cfg.model_type}", None, "model_not_base")
        try:
            key = check_name(name)
        except ValueError as e:
            raise APIError(400, str(e), "name") from e
        if s.voices.get(key) is not None:
            raise APIError(409, f"voice {key!r} already exists; DELETE /v1/audio/voices/{key} first", "name",
                           "voice_exists")
        data = await audio.read(s.settings.max_ref_audio_bytes + 1)
        if len(data) > s.settings.max_ref_audio_bytes:
            raise APIError(413, f"the audio file is over the {s.settings.max_ref_audio_bytes}-byte limit: send a "
                                "shorter clip", "audio", "ref_audio_too_large")
        xvec = not ref_text if x_vector_only_mode is None else x_vector_only_mode
        loop = asyncio.get_running_loop()
        voice = await loop.run_in_executor(s.builder, _make_voice, s, key, data, ref_text, xvec)
        return JSONResponse(voice.info(), status_code=201)

    @v1.delete("/audio/voices/{name}")
    async def delete_voice(name: str, request: Request):
        s = _state(request)
        if not await asyncio.to_thread(s.voices.delete, name):
            raise APIError(404, f"voice {name!r} does not exist (see GET /v1/audio/voices)", "name",
                           "voice_not_found")
        return {"name": name.strip().lower(), "object": "voice", "deleted": True}

    app.include_router(v1)
    return app


def _make_voice(s: ServerState, key: str, data: bytes, ref_text: str | None, xvec: bool):
    wav, sr = decode_ref_audio(data, s.settings, param="audio")
    try:
        prompt = s.tts.create_voice_clone_prompt((wav, sr), ref_text=ref_text, x_vector_only_mode=xvec)[0]
    except ValueError as e:
        raise APIError(400, str(e), param_for(str(e))) from e
    try:
        return s.voices.add(key, prompt)
    except KeyError as e:
        raise APIError(409, f"voice {key!r} already exists; DELETE /v1/audio/voices/{key} first", "name",
                       "voice_exists") from e
