"""The OpenAI-compatible HTTP server on real uvicorn (CPU, tiny checkpoints), driven by `openai` and httpx."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import socket
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import torch
import uvicorn

from nano_qwen3tts_vllm.server import ServerSettings, create_app
from nano_qwen3tts_vllm.server.voices import VoiceStore

FRAME_BYTES = 1920 * 2  # one 12.5 Hz frame of 24 kHz 16-bit PCM
GREEDY = {"temperature": 0}


class ServerThread:
    """uvicorn on 127.0.0.1 (a free port it binds itself), in a background thread."""

    def __init__(self, app, sndbuf: int | None = None):
        self.sock = socket.socket()
        if sndbuf:  # inherited by accepted connections; a small one makes a slow reader push back at once
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


# NANO_QWEN3TTS_TEST_DEVICE=cuda runs the same server tests on a GPU (fp32, CUDA graphs)
DEVICE = os.environ.get("NANO_QWEN3TTS_TEST_DEVICE", "cpu")


def load(name: str, max_num_seqs: int = 48):
    from nano_qwen3tts_vllm import Qwen3TTSInterface
    extra = dict(num_kvcache_blocks=2048) if DEVICE != "cpu" else {}
    return Qwen3TTSInterface.from_pretrained(name, device=DEVICE, dtype=torch.float32, max_num_seqs=max_num_seqs,
                                             max_model_len=256, **extra)


@pytest.fixture(scope="module")
def cv():
    tts = load("tiny-random")
    settings = ServerSettings(served_model_names=["tiny-random", "tts-1"], max_input_chars=2000)
    app = create_app(tts, settings)
    with ServerThread(app) as srv:
        yield SimpleNamespace(url=srv.url, tts=tts, app=app, settings=settings)
    tts.close()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tts = load("tiny-random-base")
    settings = ServerSettings(served_model_names=["tiny-random-base"], max_ref_audio_bytes=200_000,
                              max_ref_audio_seconds=3.0, voices_dir=str(tmp_path_factory.mktemp("voices")))
    app = create_app(tts, settings)
    with ServerThread(app) as srv:
        yield SimpleNamespace(url=srv.url, tts=tts, app=app, settings=settings)
    tts.close()


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def speak(server, **body) -> httpx.Response:
    """POST /v1/audio/speech, seeded unless the body says otherwise: the tests assert exact frame counts, and
    unseeded sampling on the random checkpoint can draw EOS early (1 of 48 unseeded 400-frame requests stopped
    at 20 frames)."""
    body.setdefault("seed", 0)
    return httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)


def wav_bytes(seconds: float, sr: int = 24000, fmt: str = "WAV") -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    rng = np.random.default_rng(0)
    wav = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)) + 0.02 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, wav.astype(np.float32), sr, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def assert_idle(tts, timeout: float = 10.0) -> None:
    """Nothing running or waiting and every KV block free (aborts are applied by the engine thread)."""
    deadline = time.monotonic() + timeout
    while True:
        s = tts.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]:
            return
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.05)


def metric(server, series: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in /metrics")


def sse_events(text: str) -> list[dict]:
    assert text.endswith("\n\n")
    events = []
    for block in text.strip("\n").split("\n\n"):
        assert block.startswith("data: "), block[:80]
        events.append(json.loads(block[len("data: "):]))
    return events


# ---- formats and streaming ------------------------------------------------------------------

def test_every_response_format_decodes(cv):
    c = client(cv)
    extra = dict(max_new_tokens=20, language="english", **GREEDY)
    pcm = c.audio.speech.create(model="tiny-random", voice="vivian", input="Every format decodes.",
                                response_format="pcm", extra_body=extra)
    assert pcm.response.headers["content-type"] == "audio/pcm"
    assert pcm.response.headers["x-sample-rate"] == "24000"
    assert len(pcm.content) == 19 * FRAME_BYTES  # max_new_tokens=20: 19 frames (the last step is EOS)
    samples = np.frombuffer(pcm.content, "<i2")
    types = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg; codecs=opus"}
    for fmt, ctype in types.items():
        r = c.audio.speech.create(model="tts-1", voice="Vivian", input="Every format decodes.",
                                  response_format=fmt, extra_body=extra)
        assert r.response.headers["content-type"] == ctype
        audio, sr = sf.read(io.BytesIO(r.content), dtype="int16")
        assert sr == 24000, fmt
        if fmt in ("wav", "flac"):  # lossless: exactly the PCM samples
            np.testing.assert_array_equal(audio, samples)
        else:
            assert abs(audio.shape[0] - samples.shape[0]) < 0.1 * 24000, (fmt, audio.shape)
    # OpenAI's default format is mp3
    r = c.audio.speech.create(model="tiny-random", voice="ryan", input="Default.",
                              extra_body=dict(max_new_tokens=8, seed=0))  # seeded: no early EOS
    assert r.response.headers["content-type"] == "audio/mpeg" and sf.read(io.BytesIO(r.content))[1] == 24000


def test_streamed_equals_whole_in_greedy_mode(cv):
    c = client(cv)
    text = "Streamed bytes equal the whole clip."
    extra = dict(max_new_tokens=30, **GREEDY)
    with c.audio.speech.with_streaming_response.create(model="tiny-random", voice="ryan", input=text,
                                                       response_format="pcm", extra_body=extra) as resp:
        assert resp.headers.get("transfer-encoding") == "chunked"
        pieces = list(resp.iter_bytes())
    streamed = b"".join(pieces)
    assert len(streamed) == 29 * FRAME_BYTES
    whole = c.audio.speech.create(model="tiny-random", voice="ryan", input=text, response_format="pcm",
                                  extra_body=dict(stream=False, **extra))
    assert whole.response.headers["content-length"] == str(len(streamed))
    assert whole.content == streamed
    flac, _ = sf.read(io.BytesIO(speak(cv, input=text, voice="ryan", response_format="flac", **extra).content),
                      dtype="int16")
    assert flac.tobytes() == streamed
    # a streamed WAV: header with unknown (0xFFFFFFFF) sizes, then the same PCM
    wav = speak(cv, input=text, voice="ryan", response_format="wav", **extra).content
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt " and wav[36:40] == b"data"
    assert struct.unpack("<I", wav[4:8])[0] == struct.unpack("<I", wav[40:44])[0] == 0xFFFFFFFF
    assert struct.unpack("<HHI", wav[20:28]) == (1, 1, 24000) and wav[44:] == streamed
    whole_wav = speak(cv, input=text, voice="ryan", response_format="wav", stream=False, **extra).content
    assert struct.unpack("<I", whole_wav[40:44])[0] == len(streamed) and whole_wav[44:] == streamed
    # SSE: OpenAI's speech events; the deltas are the same PCM
    r = speak(cv, input=text, voice="ryan", stream_format="sse", **extra)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1]) and len(events) > 2
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == streamed
    # the first delta is small (first_chunk_size frames) so the first bytes leave early
    assert len(base64.b64decode(events[0]["audio"])) == cv.settings.first_chunk_size * FRAME_BYTES
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] == 29
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + 29
    assert_idle(cv.tts)


def test_legacy_body_and_seeded_sampling(cv):
    r = speak(cv, text="The old body.", speaker="eric", language="english", response_format="pcm", max_new_tokens=10)
    assert r.status_code == 200 and len(r.content) == 9 * FRAME_BYTES
    seeded = dict(input="Seeded sampling repeats.", voice="aiden", response_format="pcm", max_new_tokens=12,
                  temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=7)
    a, b = speak(cv, **seeded).content, speak(cv, **seeded).content
    assert a == b and len(a) == 11 * FRAME_BYTES


def test_concurrent_streaming_clients(cv):
    """40 streams at once (batched by the engine) equal their solo greedy results; then all blocks are free."""
    texts = [f"Client group {i} speaks at the same time as the others." for i in range(4)]
    body = dict(voice="serena", response_format="pcm", max_new_tokens=16, **GREEDY)
    solo = {t: speak(cv, input=t, **body).content for t in texts}
    assert all(len(v) == 15 * FRAME_BYTES for v in solo.values())

    async def one(http: httpx.AsyncClient, text: str) -> tuple[str, bytes, float]:
        t0 = time.perf_counter()
        first = None
        async with http.stream("POST", "/v1/audio/speech", json=dict(input=text, **body)) as r:
            assert r.status_code == 200, await r.aread()
            data = b""
            async for piece in r.aiter_bytes():
                first = first or time.perf_counter() - t0
                data += piece
        return text, data, first

    async def run_all():
        async with httpx.AsyncClient(base_url=cv.url, timeout=120) as http:
            return await asyncio.gather(*(one(http, texts[i % 4]) for i in range(40)))
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], cv.tts.stats()["running"])
            time.sleep(0.01)
    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.perf_counter()
    try:
        results = asyncio.run(run_all())
    finally:
        stop.set()
        watcher.join()
    assert time.perf_counter() - t0 < 90
    assert peak[0] >= 20  # they really were batched together
    for text, data, _ in results:
        assert data == solo[text]
    assert_idle(cv.tts)
    assert cv.app.state.server.in_flight == 0


def test_client_disconnect_aborts_and_frees_blocks(cv):
    body = dict(input="A long answer that nobody listens to the end of.", voice="vivian", max_new_tokens=200)
    for extra in (dict(response_format="pcm"), dict(stream_format="sse")):
        with httpx.Client(base_url=cv.url, timeout=60) as http:
            with http.stream("POST", "/v1/audio/speech", json=dict(body, **extra)) as r:
                assert r.status_code == 200
                next(r.iter_raw())
                assert cv.tts.stats()["running"] == 1
        assert_idle(cv.tts)  # long before 200 frames could have been generated
    # a whole-clip format: the client gives up before any byte is sent
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cv.url + "/v1/audio/speech", json=dict(body, response_format="mp3"), timeout=1.0)
    assert_idle(cv.tts)
    deadline = time.monotonic() + 10
    while (cv.app.state.server.in_flight or cv.tts.codecs.slots.in_use()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cv.app.state.server.in_flight == 0
    assert cv.tts.codecs.slots.in_use() == 0  # every stream gave its decoder slot back
    assert metric(cv, 'nano_qwen3tts_speech_outcomes_total{outcome="disconnected"}') >= 3


def raw_request(server, body: dict, rcvbuf: int = 4096) -> socket.socket:
    """A POST on a socket with a small receive buffer, so a client that does not read pushes back at once."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(data), data))
    return sock


def read_chunked(sock: socket.socket) -> tuple[bytes, bytes]:
    raw = b""
    while piece := sock.recv(65536):
        raw += piece
    head, _, rest = raw.partition(b"\r\n\r\n")
    body = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return head, body
        body, rest = body + rest[:size], rest[size + 2:]


def test_client_leaving_while_queued_in_the_engine_is_aborted():
    tts = load("tiny-random", max_num_seqs=1)
    try:
        with ServerThread(create_app(tts, ServerSettings(served_model_names=["m"]))) as srv:
            body = dict(input="Taking the only sequence slot.", voice="ryan", response_format="pcm",
                        max_new_tokens=200)
            with httpx.Client(base_url=srv.url, timeout=60) as http:
                with http.stream("POST", "/v1/audio/speech", json=body) as first:
                    assert first.status_code == 200
                    with pytest.raises(httpx.ReadTimeout):  # waits behind it, then gives up
                        httpx.post(srv.url + "/v1/audio/speech", json=dict(body, input="Queued."), timeout=1.0)
                    deadline = time.monotonic() + 10
                    while tts.stats()["waiting"] and time.monotonic() < deadline:
                        time.sleep(0.05)
                    assert tts.stats()["waiting"] == 0 and tts.stats()["running"] == 1
                    assert srv.server.config.app.state.server.in_flight == 1
            assert_idle(tts)
    finally:
        tts.close()


def test_slow_reader_does_not_stall_others(cv):
    """A client that reads nothing fills the socket buffers (kept small here) and its response waits, while
    other requests go on and the engine finishes the unread one (its frames wait for the reader)."""
    with ServerThread(create_app(cv.tts, ServerSettings(served_model_names=["m"])), sndbuf=8192) as srv:
        state = srv.server.config.app.state.server
        slow = raw_request(srv, dict(input="I read nothing for a while.", voice="dylan", response_format="pcm",
                                     max_new_tokens=200, seed=5))  # seeded, as speak() sends
        try:
            t0 = time.perf_counter()
            for i in range(3):
                fast = speak(srv, input=f"I am not held up, {i}.", voice="eric", response_format="pcm",
                             max_new_tokens=12)
                assert fast.status_code == 200 and len(fast.content) == 11 * FRAME_BYTES
            assert time.perf_counter() - t0 < 30
            assert_idle(cv.tts, timeout=30)
            time.sleep(1.0)
            assert state.in_flight == 1  # still blocked on the slow client
            head, data = read_chunked(slow)  # which still gets all of its audio
        finally:
            slow.close()
        assert head.startswith(b"HTTP/1.1 200") and len(data) == 199 * FRAME_BYTES
        assert state.in_flight == 0
    assert_idle(cv.tts)


def test_queue_full_answers_429_at_once(cv):
    cv.settings.max_queue = 1
    try:
        with httpx.Client(base_url=cv.url, timeout=60) as http:
            with http.stream("POST", "/v1/audio/speech", json=dict(input="Holding the only slot.", voice="ryan",
                                                                   response_format="pcm", max_new_tokens=200)) as r:
                assert r.status_code == 200
                t0 = time.perf_counter()
                full = speak(cv, input="No room.", voice="ryan", response_format="pcm", max_new_tokens=5)
                assert time.perf_counter() - t0 < 2
                assert full.status_code == 429 and full.headers["retry-after"] == "1"
                assert full.json()["error"]["code"] == "queue_full"
                with pytest.raises(openai.RateLimitError):
                    client(cv).audio.speech.create(model="tiny-random", voice="ryan", input="No room.")
    finally:
        cv.settings.max_queue = None
    assert_idle(cv.tts)
    assert speak(cv, input="Room again.", voice="ryan", response_format="pcm", max_new_tokens=5).status_code == 200


def test_no_free_decoder_slot_answers_429(cv):
    pool = cv.tts.codecs.slots
    held = [pool.acquire() for _ in range(pool.n - pool.in_use())]
    try:
        r = speak(cv, input="No decoder slot.", voice="ryan", response_format="pcm", max_new_tokens=5)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "streams_busy"
        assert "streaming decoder slots are in use" in r.json()["error"]["message"]
        assert metric(cv, "nano_qwen3tts_codec_streams") == metric(cv, "nano_qwen3tts_codec_streams_max") == pool.n
    finally:
        for slot in held:
            pool.release(slot)
    assert_idle(cv.tts)
    assert speak(cv, input="Slots again.", voice="ryan", response_format="pcm", max_new_tokens=5).status_code == 200


# ---- bad input ------------------------------------------------------------------------------

OK = dict(input="Hello.", voice="vivian", response_format="pcm", max_new_tokens=6)
CV_BAD = [
    ("unknown voice", dict(voice="nobody"), 400, "voice"),
    ("missing voice", dict(voice=None), 400, "voice"),
    ("unknown language", dict(language="klingon"), 400, "language"),
    ("empty input", dict(input=""), 400, "input"),
    ("blank input", dict(input="  \n "), 400, "input"),
    ("input over the server's limit", dict(input="a" * 2001), 400, "input"),
    ("prompt longer than the model length", dict(input="word " * 300), 400, "input"),
    ("input not a string", dict(input=5), 400, "input"),
    ("missing input", dict(input=None), 400, "input"),
    ("unknown field", dict(volume=11), 400, "volume"),
    ("unknown model", dict(model="gpt-4o-mini-tts"), 404, "model"),
    ("aac", dict(response_format="aac"), 400, "response_format"),
    ("unknown format", dict(response_format="ogg"), 400, "response_format"),
    ("unknown stream_format", dict(stream_format="chunked"), 400, "stream_format"),
    ("sse with mp3", dict(stream_format="sse", response_format="mp3"), 400, "response_format"),
    ("sse with stream false", dict(stream_format="sse", stream=False), 400, "stream"),
    ("speed", dict(speed=1.5), 400, "speed"),
    ("task_type of another model", dict(task_type="Base"), 400, "task_type"),
    ("unknown task_type", dict(task_type="Singing"), 400, "task_type"),
    ("max_new_tokens zero", dict(max_new_tokens=0), 400, "max_new_tokens"),
    ("max_new_tokens beyond capacity", dict(max_new_tokens=100000), 400, "max_new_tokens"),
    ("max_new_tokens not a number", dict(max_new_tokens="many"), 400, "max_new_tokens"),
    ("negative temperature", dict(temperature=-1), 400, "temperature"),
    ("top_p zero", dict(top_p=0), 400, "top_p"),
    ("negative top_k", dict(top_k=-1), 400, "top_k"),
    ("negative seed", dict(seed=-1), 400, "seed"),
    ("repetition_penalty zero", dict(repetition_penalty=0), 400, "repetition_penalty"),
]


@pytest.mark.parametrize("case, override, status, param", CV_BAD, ids=[c[0] for c in CV_BAD])
def test_bad_input(cv, case, override, status, param):
    body = {k: v for k, v in dict(OK, **override).items() if v is not None}
    r = speak(cv, **body)
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}


def test_malformed_requests_and_server_keeps_serving(cv):
    r = httpx.post(cv.url + "/v1/audio/speech", content=b'{"input": "Hel', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(cv.url + "/v1/audio/speech", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(cv.url + "/v1/audio/speech").status_code == 405
    r = httpx.get(cv.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError, match="unsupported speakers"):
        client(cv).audio.speech.create(model="tiny-random", voice="alloy", input="Hi.")
    with pytest.raises(openai.NotFoundError):
        client(cv).audio.speech.create(model="tts-2", voice="vivian", input="Hi.")
    assert_idle(cv.tts)
    r = speak(cv, **OK)
    assert r.status_code == 200 and len(r.content) == 5 * FRAME_BYTES


BASE_BAD = [
    ("no ref_audio and no voice", dict(voice=None), 400, "voice"),
    ("unregistered voice", dict(voice="stranger"), 400, "voice"),
    ("ref_audio not audio", dict(ref_audio=b64(b"not audio at all" * 40), x_vector_only_mode=True), 400, "ref_audio"),
    ("ref_audio broken data URL", dict(ref_audio="data:audio/wav;base64," + b64(b"RIFF garbage" * 40),
                                       x_vector_only_mode=True), 400, "ref_audio"),
    ("ref_audio a remote URL", dict(ref_audio="https://example.com/v.wav", x_vector_only_mode=True), 400, "ref_audio"),
    ("ref_audio a server path", dict(ref_audio="/etc/passwd", x_vector_only_mode=True), 400, "ref_audio"),
    ("ref_audio a file URL", dict(ref_audio="file:///etc/passwd", x_vector_only_mode=True), 400, "ref_audio"),
    ("ref_audio over the byte limit", dict(ref_audio=b64(wav_bytes(5.0)), x_vector_only_mode=True), 413, "ref_audio"),
    ("ref_audio over the duration limit", dict(ref_audio=b64(wav_bytes(4.0, sr=8000)), x_vector_only_mode=True),
     400, "ref_audio"),
    ("ICL without ref_text", dict(ref_audio=b64(wav_bytes(1.0))), 400, "ref_text"),
    ("task_type of another model", dict(task_type="CustomVoice", voice="vivian"), 400, "task_type"),
]


@pytest.mark.parametrize("case, override, status, param", BASE_BAD, ids=[c[0] for c in BASE_BAD])
def test_base_bad_input(base, case, override, status, param):
    body = {k: v for k, v in dict(OK, voice="alloy").items() | override.items() if v is not None}
    r = speak(base, **body)
    assert r.status_code == status, r.text[:300]
    assert r.json()["error"]["param"] == param
    assert_idle(base.tts)


def test_ref_audio_from_urls_and_paths_when_allowed(base, tmp_path):
    import functools
    import http.server
    (tmp_path / "ref.wav").write_bytes(wav_bytes(1.0))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    settings = ServerSettings(served_model_names=["m"], allow_remote_audio=True, allow_local_audio=True)
    body = dict(input="From elsewhere.", x_vector_only_mode=True, response_format="pcm", max_new_tokens=6, **GREEDY)
    try:
        with ServerThread(create_app(base.tts, settings)) as srv:
            inline = speak(srv, ref_audio=b64(wav_bytes(1.0)), **body)
            assert inline.status_code == 200 and len(inline.content) == 5 * FRAME_BYTES
            url = f"http://127.0.0.1:{files.server_address[1]}/ref.wav"
            for ref in (url, str(tmp_path / "ref.wav"), f"file://{tmp_path}/ref.wav"):
                r = speak(srv, ref_audio=ref, **body)
                assert r.status_code == 200 and r.content == inline.content, ref
            assert speak(srv, ref_audio=url + ".missing", **body).status_code == 400
            assert speak(srv, ref_audio=str(tmp_path / "missing.wav"), **body).status_code == 400
    finally:
        files.shutdown()
    assert_idle(base.tts)


# ---- voices ---------------------------------------------------------------------------------

def test_voice_clone_inline_and_registered(base):
    ref = wav_bytes(2.0)
    body = dict(input="Cloned from a reference.", response_format="pcm", max_new_tokens=12, **GREEDY)
    inline = speak(base, ref_audio="data:audio/wav;base64," + b64(ref), ref_text="A reference.", **body)
    assert inline.status_code == 200 and len(inline.content) == 11 * FRAME_BYTES
    xvec_inline = speak(base, ref_audio=b64(ref), x_vector_only_mode=True, **body)
    assert xvec_inline.status_code == 200 and xvec_inline.content != inline.content

    voices = base.url + "/v1/audio/voices"
    r = httpx.post(voices, data={"name": "Narrator", "ref_text": "A reference."},
                   files={"audio": ("ref.wav", ref, "audio/wav")}, timeout=60)
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "narrator" and r.json()["x_vector_only_mode"] is False
    flac = wav_bytes(2.0, fmt="FLAC")
    r = httpx.post(voices, data={"name": "plain"}, files={"audio": ("ref.flac", flac)}, timeout=60)
    assert r.status_code == 201 and r.json()["x_vector_only_mode"] is True  # no ref_text: speaker embedding only
    listed = httpx.get(voices).json()
    assert {"narrator", "plain"} <= set(listed["voices"])
    assert {v["name"] for v in listed["uploaded_voices"]} == {"narrator", "plain"}

    # a registered voice gives exactly the audio of the same reference sent inline
    assert speak(base, voice="NARRATOR", **body).content == inline.content
    c = client(base)
    assert c.audio.speech.create(model="tiny-random-base", voice="plain", input=body["input"], response_format="pcm",
                                 extra_body=dict(max_new_tokens=12, **GREEDY)).content == xvec_inline.content

    # stored as safetensors + JSON (no pickle) and reloaded as they were
    files = sorted(p.name for p in Path(base.settings.voices_dir).iterdir())
    assert files == ["narrator.json", "narrator.safetensors", "plain.json", "plain.safetensors"]
    again = VoiceStore(base.settings.voices_dir)
    old, new = base.app.state.server.voices.get("narrator").prompt, again.get("narrator").prompt
    assert torch.equal(old.ref_code.cpu(), new.ref_code) and new.ref_text == "A reference." and new.icl_mode
    assert torch.allclose(old.ref_spk_embedding.float().cpu(), new.ref_spk_embedding)

    # registration errors
    def register(name, audio=ref, **data):
        return httpx.post(voices, data={"name": name, **data}, files={"audio": ("a.wav", audio)}, timeout=60)
    assert register("narrator").status_code == 409
    assert register("../etc/passwd").status_code == 400
    assert register("garbage", audio=b"not audio" * 100).status_code == 400
    assert register("big", audio=wav_bytes(5.0)).status_code == 413
    assert register("long", audio=wav_bytes(4.0, sr=8000)).status_code == 400
    assert register("icl", x_vector_only_mode="false").status_code == 400  # ICL needs ref_text
    assert httpx.post(voices, data={"name": "nofile"}).status_code == 400

    assert httpx.delete(voices + "/narrator").status_code == 200
    assert httpx.delete(voices + "/narrator").status_code == 404
    assert "narrator" not in httpx.get(voices).json()["voices"]
    assert speak(base, voice="narrator", **body).status_code == 400
    assert sorted(p.name for p in Path(base.settings.voices_dir).iterdir()) == \
        ["plain.json", "plain.safetensors"]
    assert_idle(base.tts)


def test_voices_on_a_custom_voice_model(cv):
    listed = httpx.get(cv.url + "/v1/audio/voices").json()
    assert listed["voices"] == cv.tts.get_supported_speakers() and listed["uploaded_voices"] == []
    r = httpx.post(cv.url + "/v1/audio/voices", data={"name": "x"}, files={"audio": ("a.wav", wav_bytes(1.0))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_base"


def test_voice_design_model():
    tts = load("tiny-random-voice-design")
    try:
        with ServerThread(create_app(tts, ServerSettings(served_model_names=["vd"]))) as srv:
            c = client(srv)
            designed = dict(model="vd", voice="ignored", input="A designed voice.", response_format="pcm",
                            instructions="A calm, low voice.", extra_body=dict(max_new_tokens=10, **GREEDY))
            a = c.audio.speech.create(**designed).content
            assert len(a) == 9 * FRAME_BYTES
            assert c.audio.speech.create(**dict(designed, voice="alloy")).content == a
            assert c.audio.speech.create(**dict(designed, instructions="A bright, fast voice.")).content != a
            r = speak(srv, input="Hi.", task_type="CustomVoice", voice="vivian")
            assert r.status_code == 400 and r.json()["error"]["param"] == "task_type"
    finally:
        tts.close()


# ---- models, auth, health, metrics ----------------------------------------------------------

def test_models(cv):
    models = client(cv).models.list()
    assert [m.id for m in models.data] == ["tiny-random", "tts-1"]


def test_api_key(cv):
    settings = ServerSettings(served_model_names=["tiny-random"], api_key="sk-secret")
    with ServerThread(create_app(cv.tts, settings)) as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-secret"}):
            r = httpx.get(srv.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.post(srv.url + "/v1/audio/speech", json=OK, headers=headers)
            assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(srv, api_key="wrong").models.list()
        ok = client(srv, api_key="sk-secret")
        assert [m.id for m in ok.models.list().data] == ["tiny-random"]
        r = ok.audio.speech.create(model="tiny-random", voice="vivian", input="Hi.", response_format="pcm",
                                   extra_body=dict(max_new_tokens=6, seed=0))  # seeded: no early EOS
        assert len(r.content) == 5 * FRAME_BYTES
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200


def test_health_and_metrics(cv):
    assert httpx.get(cv.url + "/health").json() == {"status": "ok"}
    series = ("time_to_first_audio_seconds", "time_to_first_byte_seconds", "first_chunk_decode_seconds")
    before = {k: (metric(cv, f"nano_qwen3tts_{k}_count"), metric(cv, f"nano_qwen3tts_{k}_sum")) for k in series}
    # one good and one bad request of its own, so the counters below never depend on other tests
    assert speak(cv, model="tts-1", input="Counted.", voice="vivian", response_format="pcm", max_new_tokens=4,
                 **GREEDY).status_code == 200
    # the streamed request's first audio: codec decode <= first chunk ready <= first bytes sent
    delta = {k: (metric(cv, f"nano_qwen3tts_{k}_count") - n, metric(cv, f"nano_qwen3tts_{k}_sum") - t)
             for k, (n, t) in before.items()}
    assert [n for n, _ in delta.values()] == [1, 1, 1], delta
    ttfa, ttfb, decode = (t for _, t in delta.values())
    assert 0 < decode <= ttfa <= ttfb < 60, delta
    assert speak(cv, model="tts-1", input="", voice="vivian").status_code == 400
    r = httpx.get(cv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("nano_qwen3tts_requests_running", "nano_qwen3tts_requests_waiting", "nano_qwen3tts_kv_usage",
                 "nano_qwen3tts_time_to_first_audio_seconds_bucket", "nano_qwen3tts_real_time_factor_bucket",
                 "nano_qwen3tts_requests_in_flight"):
        assert f"\n{name}" in text, name
    assert 'nano_qwen3tts_http_requests_total{route="/v1/audio/speech",status="200"}' in text
    assert 'nano_qwen3tts_http_requests_total{route="/v1/audio/speech",status="400"}' in text
    assert 'nano_qwen3tts_speech_outcomes_total{outcome="completed"}' in text
    # where time to first audio goes: queueing before the first prefill, then up to the first frame
    n = metric(cv, "nano_qwen3tts_request_queue_seconds_count")
    assert n >= 1 and n == metric(cv, "nano_qwen3tts_time_to_first_frame_seconds_count")
    queued = metric(cv, "nano_qwen3tts_request_queue_seconds_sum")
    assert 0 <= queued < metric(cv, "nano_qwen3tts_time_to_first_frame_seconds_sum") < 60 * n

    dead = SimpleNamespace(stats=lambda: dict(running=0, waiting=0, kv_usage=0.0, alive=0.0, max_num_seqs=1),
                           model_cfg=SimpleNamespace(model_type="custom_voice"), get_supported_speakers=lambda: [])
    with ServerThread(create_app(dead)) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


def test_killed_worker_fails_the_stream_then_the_server_recovers():
    """Worker processes behind the server: kill the talker mid-stream; that stream ends early (its
    200 was already sent), /health reports the engine down while it restarts, then the server serves again."""
    import os
    import signal
    from nano_qwen3tts_vllm import Qwen3TTSInterface
    tts = Qwen3TTSInterface.from_pretrained("tiny-random", device=DEVICE, dtype=torch.float32, max_num_seqs=4,
                                            max_model_len=512, multiprocess=True)
    try:
        with ServerThread(create_app(tts, ServerSettings(served_model_names=["m"]))) as srv:
            body = dict(model="m", input="A long stream that will be cut.", voice="vivian", response_format="pcm",
                        max_new_tokens=400, **GREEDY)
            received, broken = 0, False
            with httpx.stream("POST", f"{srv.url}/v1/audio/speech", json=body, timeout=120) as r:
                assert r.status_code == 200
                chunks = r.iter_bytes()
                received += len(next(chunks))
                os.kill(tts.engine.engine.executor.procs["talker"].pid, signal.SIGKILL)
                try:
                    for chunk in chunks:
                        received += len(chunk)
                except httpx.HTTPError:
                    broken = True
            assert broken or received < 399 * FRAME_BYTES, "the cut stream must not look complete"
            deadline = time.monotonic() + 120
            while httpx.get(f"{srv.url}/health").status_code != 200:
                assert time.monotonic() < deadline, "the workers did not come back"
                time.sleep(0.5)
            r = speak(srv, model="m", input="Back again.", voice="vivian", response_format="pcm",
                      max_new_tokens=10, **GREEDY)
            assert r.status_code == 200 and len(r.content) == 9 * FRAME_BYTES
            assert_idle(tts)
    finally:
        tts.close()


# ---- the command line -----------------------------------------------------------------------

def test_cli_serves_and_stops_on_sigterm(tmp_path):
    """The real command (multiprocess engine when the interface has it): serve, answer, exit on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "nano_qwen3tts_vllm.serve", "--model", "tiny-random", "--port",
                             str(port), "--max-num-seqs", "4", "--max-model-len", "256", "--dtype", "float32",
                             "--device", DEVICE, "--served-model-name", "tts-1", "--api-key", "sk-cli"]
                            + (["--gpu-memory-utilization", "0.3"] if DEVICE != "cpu" else []),
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (log.seek(0), log.read()[-3000:])
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.25)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-cli", max_retries=0)
        r = c.audio.speech.create(model="tts-1", voice="vivian", input="From the command line.",
                                  response_format="pcm", extra_body=dict(max_new_tokens=8, **GREEDY))
        assert len(r.content) == 7 * FRAME_BYTES
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    text = log.read()
    assert "closing the engine" in text
    for pid in map(int, re.findall(r"'(?:talker|predictor)': (\d+)", text)):  # no orphaned workers
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)



def test_cli_arguments(monkeypatch):
    from nano_qwen3tts_vllm import serve
    monkeypatch.setenv("NANO_QWEN3TTS_API_KEY", "sk-env")
    args = serve.parse_args(["serve", "--model", "tiny-random", "--port", "9000", "--max-num-seqs", "8",
                             "--talker-device", "cuda:0"])
    assert (args.model, args.host, args.port, args.api_key, args.max_num_seqs) == \
        ("tiny-random", "127.0.0.1", 9000, "sk-env", 8)
    assert serve.parse_args(["--model", "m"]).first_chunk_size == 3

    seen = {}

    class Fake:
        @classmethod
        def from_pretrained(cls, model, device=None, dtype=None, **engine):  # before multiprocess existed
            seen.update(engine, model=model, device=device)
    monkeypatch.setattr("nano_qwen3tts_vllm.api.interface.Qwen3TTSInterface", Fake)
    serve.load_model(serve.parse_args(["--model", "m", "--max-num-seqs", "4", "--enforce-eager"]))
    assert seen == dict(model="m", device=None, max_num_seqs=4, enforce_eager=True)
    with pytest.raises(SystemExit, match="talker-device"):
        serve.load_model(args)

    class FakeMP:
        @classmethod
        def from_pretrained(cls, model, device=None, dtype=None, multiprocess=False, talker_device=None,
                            predictor_device=None, **engine):
            seen.clear()
            seen.update(engine, multiprocess=multiprocess, talker_device=talker_device)
    monkeypatch.setattr("nano_qwen3tts_vllm.api.interface.Qwen3TTSInterface", FakeMP)
    serve.load_model(args)
    assert seen == dict(max_num_seqs=8, multiprocess=True, talker_device="cuda:0")
