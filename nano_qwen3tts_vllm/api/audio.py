"""Reference-audio inputs (as qwen-tts accepts them) and chunked streaming decode."""
from __future__ import annotations

import base64
import binascii
import io
import urllib.request
from urllib.parse import urlparse

import numpy as np
import torch

AudioLike = "str | tuple[np.ndarray, int]"


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


class StreamingDecoder:
    """Turns frames into audio chunks as they arrive.

    Each chunk decodes its new frames together with up to `left_context` earlier frames and
    keeps only the new samples; the codec decoder is causal, so with enough context the chunks
    join without a seam. The first chunk can be smaller, for a fast first packet.
    """

    def __init__(self, codec_model, chunk_size: int = 12, first_chunk_size: int = 4, left_context: int = 72):
        if chunk_size < 1 or first_chunk_size < 1 or left_context < 0:
            raise ValueError("chunk_size and first_chunk_size must be >= 1, left_context >= 0")
        self.codec = codec_model  # Qwen3TTSTokenizerV2Model
        self.chunk_size, self.first_chunk_size, self.left_context = chunk_size, first_chunk_size, left_context
        self.upsample = codec_model.get_decode_upsample_rate()
        self.frames: list[list[int]] = []
        self.emitted = 0

    def push(self, frame: list[int]) -> np.ndarray | None:
        self.frames.append(frame)
        want = self.first_chunk_size if self.emitted == 0 else self.chunk_size
        return self._decode() if len(self.frames) - self.emitted >= want else None

    def flush(self) -> np.ndarray | None:
        return self._decode() if len(self.frames) > self.emitted else None

    @torch.inference_mode()
    def _decode(self) -> np.ndarray:
        start = max(0, self.emitted - self.left_context)
        dev = next(self.codec.parameters()).device
        codes = torch.tensor(self.frames[start:], dtype=torch.long, device=dev)  # [T, 16]
        wav = self.codec.decoder(codes.T.unsqueeze(0)).squeeze(0).squeeze(0)
        out = wav[(self.emitted - start) * self.upsample:len(self.frames[start:]) * self.upsample]
        self.emitted = len(self.frames)
        return out.float().cpu().numpy()
