"""Float32 audio to the response formats: raw PCM16, WAV (also with an open-ended header), FLAC, MP3, Opus."""
from __future__ import annotations

import io
import struct

import numpy as np

CONTENT_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg",
                 "opus": "audio/ogg; codecs=opus"}
_SOUNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}


def to_pcm16(audio: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")


def pcm16_bytes(audio: np.ndarray) -> bytes:
    return to_pcm16(audio).tobytes()


def wav_header(sample_rate: int, num_samples: int | None = None) -> bytes:
    """44-byte PCM16 mono header; num_samples=None writes 0xFFFFFFFF sizes (length unknown: streaming)."""
    if num_samples is None:
        riff_size = data_size = 0xFFFFFFFF
    else:
        data_size = num_samples * 2
        riff_size = 36 + data_size
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_size))


def encode(audio: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """The whole clip in one format; lossless formats hold exactly the PCM16 samples."""
    pcm = to_pcm16(audio)
    if fmt == "pcm":
        return pcm.tobytes()
    if fmt == "wav":
        return wav_header(sample_rate, pcm.size) + pcm.tobytes()
    import soundfile as sf
    container, subtype = _SOUNDFILE[fmt]
    buf = io.BytesIO()
    sf.write(buf, pcm, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()
