"""Reference-audio inputs (as qwen-tts accepts them) and chunked streaming decode."""
from __future__ import annotations

import base64
import binascii
import io
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlparse

import numpy as np
import torch


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


@dataclass
class DecodeWindow:
    """One streaming chunk to decode: frames [T, 16] whose samples [start, end) are the new audio."""
    codes: list[list[int]]
    start: int
    end: int


class StreamingDecoder:
    """Plans the audio chunks of one stream as its frames arrive.

    Each chunk decodes its new frames together with up to `left_context` earlier frames and
    keeps only the new samples; the codec decoder is causal, so with enough context the chunks
    join without a seam. The first chunk can be smaller, for a fast first packet. Decoding itself
    is done by the caller: `decode_windows` here, or the batched codec worker process.
    """

    def __init__(self, upsample: int, chunk_size: int = 12, first_chunk_size: int = 4, left_context: int = 72,
                 context: list[list[int]] | None = None):
        if chunk_size < 1 or first_chunk_size < 1 or left_context < 0:
            raise ValueError("chunk_size and first_chunk_size must be >= 1, left_context >= 0")
        self.upsample = upsample
        self.chunk_size, self.first_chunk_size, self.left_context = chunk_size, first_chunk_size, left_context
        self.frames: list[list[int]] = list(context or [])  # context (ICL reference codes) is never emitted
        self.emitted = len(self.frames)
        self.first = True

    def push(self, frame: list[int]) -> DecodeWindow | None:
        self.frames.append(frame)
        want = self.first_chunk_size if self.first else self.chunk_size
        return self._window() if len(self.frames) - self.emitted >= want else None

    def flush(self) -> DecodeWindow | None:
        return self._window() if len(self.frames) > self.emitted else None

    def _window(self) -> DecodeWindow:
        start = max(0, self.emitted - self.left_context)
        window = DecodeWindow(self.frames[start:], (self.emitted - start) * self.upsample,
                              (len(self.frames) - start) * self.upsample)
        self.emitted, self.first = len(self.frames), False
        return window


@torch.inference_mode()
def decode_windows(codec_model, windows: list[DecodeWindow]) -> list[np.ndarray]:
    """Decode windows of any lengths in one batch: right-padded (the decoder is causal, so padding
    after a window cannot change its samples), then each cropped to its new samples."""
    dev = next(codec_model.parameters()).device
    longest = max(len(w.codes) for w in windows)
    codes = torch.zeros(len(windows), longest, len(windows[0].codes[0]), dtype=torch.long)
    for i, w in enumerate(windows):
        codes[i, :len(w.codes)] = torch.tensor(w.codes, dtype=torch.long)
    wav = codec_model.decoder(codes.transpose(1, 2).to(dev)).squeeze(1).float().cpu()
    return [wav[i, w.start:w.end].numpy() for i, w in enumerate(windows)]
