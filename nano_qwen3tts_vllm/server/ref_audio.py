"""Reference audio from a request: base64 or a data URL; http(s) URLs and server-side paths only when enabled.

Limits (bytes, seconds) are checked here, before the audio reaches the speaker encoder.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
import urllib.request
from urllib.parse import urlparse

import numpy as np

from ..api.audio import decode_audio_bytes
from .errors import APIError
from .settings import ServerSettings

_BASE64 = re.compile(r"[A-Za-z0-9+/=_\-\s]+")


def _too_big(size: int, limit: int) -> APIError:
    return APIError(413, f"reference audio is {size} bytes; the limit is {limit} bytes: send a shorter clip",
                    "ref_audio", "ref_audio_too_large")


def _refused(what: str, flag: str) -> APIError:
    return APIError(400, f"ref_audio {what}, which this server does not accept (start it with {flag} to allow "
                         "it); send the audio itself as base64 or a data URL", "ref_audio", "ref_audio_not_allowed")


def _fetch(url: str, limit: int) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            data = resp.read(limit + 1)
    except (OSError, ValueError) as e:  # URLError is an OSError
        raise APIError(400, f"could not fetch reference audio from {url}: {e}", "ref_audio") from e
    if len(data) > limit:
        raise _too_big(len(data), limit)
    return data


def _read_file(path: str, limit: int) -> bytes:
    try:
        size = os.path.getsize(path)
        if size > limit:
            raise _too_big(size, limit)
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise APIError(400, f"could not read reference audio file {path!r}: {e.strerror}", "ref_audio") from e


def _base64(data: str, limit: int) -> bytes:
    if len(data) * 3 // 4 > limit + 3:
        raise _too_big(len(data) * 3 // 4, limit)
    try:
        raw = base64.b64decode(data, altchars=b"-_" if ("-" in data or "_" in data) else None, validate=False)
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"ref_audio is not valid base64: {e}", "ref_audio") from e
    if len(raw) > limit:
        raise _too_big(len(raw), limit)
    return raw


def ref_audio_bytes(value: str, settings: ServerSettings) -> bytes:
    """The encoded audio file a ref_audio string stands for."""
    value = value.strip()
    limit = settings.max_ref_audio_bytes
    scheme = urlparse(value).scheme.lower() if ":" in value[:12] else ""
    if scheme == "data":
        head, _, data = value.partition(",")
        if not data or ";base64" not in head:
            raise APIError(400, "a ref_audio data URL must be base64: data:audio/wav;base64,<data>", "ref_audio")
        return _base64(data, limit)
    if scheme in ("http", "https"):
        if not settings.allow_remote_audio:
            raise _refused("is a URL", "--allow-remote-audio")
        return _fetch(value, limit)
    # base64 of raw MP3 frames starts with "//", so only short or non-base64 strings are taken for paths
    if scheme == "file" or len(value) < 256 or not _BASE64.fullmatch(value):
        if not settings.allow_local_audio:
            raise _refused("is not base64 audio, so it is taken for a server-side path", "--allow-local-audio")
        path = urlparse(value).path if scheme == "file" else os.path.expanduser(value)
        return _read_file(path, limit)
    return _base64(value, limit)


def decode_ref_audio(data: bytes, settings: ServerSettings, param: str = "ref_audio") -> tuple[np.ndarray, int]:
    """Decoded mono float32 waveform and its sample rate, within the duration limit."""
    try:
        wav, sr = decode_audio_bytes(data)
    except ValueError as e:
        raise APIError(400, str(e), param, "invalid_audio") from e
    if wav.ndim > 1:
        wav = wav.mean(axis=-1)
    seconds = wav.shape[0] / sr
    if wav.size == 0 or not np.isfinite(wav).all():
        raise APIError(400, "reference audio is empty or contains NaN/inf samples", param, "invalid_audio")
    if seconds > settings.max_ref_audio_seconds:
        raise APIError(400, f"reference audio is {seconds:.1f} s long; the limit is "
                            f"{settings.max_ref_audio_seconds:g} s: send a shorter clip", param, "ref_audio_too_long")
    return wav.astype(np.float32), sr


def load_ref_audio(value: str, settings: ServerSettings) -> tuple[np.ndarray, int]:
    """Blocking (a URL fetch, decoding): call it from a worker thread."""
    return decode_ref_audio(ref_audio_bytes(value, settings), settings)
