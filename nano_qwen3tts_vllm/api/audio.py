"""Reference-audio inputs (as qwen-tts accepts them) and the chunking of streamed frames."""
from __future__ import annotations

import base64
import binascii
import io
import threading
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np


def _is_url(s: str) -> bool:
    u = urlparse(s)
    return u.scheme in ("http", "https") and bool(u.netloc)


def _is_probably_base64(s: str) -> bool:
    return s.startswith("data:audio") or (("/" not in s and "\\" not in s) and len(s) > 256)


def decode_audio_bytes(data: bytes) -> tuple[np.ndarray, int]:
    import soundfile as sf
    try:
        with io.BytesIO(data) as f:
            audio, sr = sf.read(f, dtype="float32", always_2d=False)
    except Exception as e:  # soundfile raises several types for garbage input
        raise ValueError(f"reference audio is not decodable audio ({e}); send WAV, FLAC or OGG data") from e
    return audio, int(sr)


def load_audio(x, allow_url: bool = True, allow_path: bool = True) -> tuple[np.ndarray, int]:
    """str (path, URL, base64 / data URL) or (waveform, sr) -> mono float32 waveform, sr."""
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], np.ndarray):
        audio, sr = x[0].astype(np.float32), int(x[1])
    elif isinstance(x, np.ndarray):
        raise ValueError("for a numpy waveform, pass a tuple (audio, sample_rate)")
    elif isinstance(x, str):
        if _is_url(x):
            if not allow_url:
                raise ValueError("reference audio URLs are not allowed here; send the audio itself (base64)")
            with urllib.request.urlopen(x, timeout=30) as resp:
                audio, sr = decode_audio_bytes(resp.read())
        elif _is_probably_base64(x):
            b64 = x.split(",", 1)[1] if x.strip().startswith("data:") and "," in x else x
            try:
                raw = base64.b64decode(b64, validate=False)
            except (binascii.Error, ValueError) as e:
                raise ValueError(f"reference audio is not valid base64: {e}") from e
            audio, sr = decode_audio_bytes(raw)
        else:
            if not allow_path:
                raise ValueError("server-side paths are not allowed as reference audio; send the audio itself")
            import librosa
            try:
                audio, sr = librosa.load(x, sr=None, mono=True)
            except Exception as e:
                raise ValueError(f"could not read reference audio file {x!r}: {e}") from e
    else:
        raise TypeError(f"unsupported audio input type: {type(x).__name__}")
    if audio.ndim > 1:
        audio = np.mean(audio, axis=-1)
    if audio.size == 0 or not np.isfinite(audio).all():
        raise ValueError("reference audio is empty or contains NaN/inf samples")
    return audio.astype(np.float32), int(sr)


class ChunkPlanner:
    """Groups the frames of one stream into audio chunks as they arrive: `first_chunk_size` frames first
    (a small first chunk is a fast first packet), then `chunk_size`. A chunk is only its new frames: the
    stateful StreamingCodecDecoder carries each stream's history."""

    def __init__(self, chunk_size: int = 12, first_chunk_size: int = 4):
        if chunk_size < 1 or first_chunk_size < 1:
            raise ValueError(f"chunk_size and first_chunk_size must be >= 1, got {chunk_size} and {first_chunk_size}")
        self.chunk_size, self.first_chunk_size = chunk_size, first_chunk_size
        self.pending: list[list[int]] = []
        self.chunks = 0  # handed out so far

    def push(self, frame: list[int]) -> list[list[int]] | None:
        self.pending.append(frame)
        want = self.first_chunk_size if self.chunks == 0 else self.chunk_size
        return self._take() if len(self.pending) >= want else None

    def flush(self) -> list[list[int]] | None:
        return self._take() if self.pending else None

    def _take(self) -> list[list[int]]:
        chunk, self.pending = self.pending, []
        self.chunks += 1
        return chunk


@dataclass
class FirstChunkStats:
    """Seconds from a stream's first chunk of frames to its audio (the codec's share of time to first audio),
    summed over streams; recorded from any thread."""
    count: int = 0
    decode_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, seconds: float) -> None:
        with self._lock:
            self.count += 1
            self.decode_s += seconds
