"""Registered voices: voice-clone prompts stored as safetensors (tensors) + JSON (text, mode), never pickle."""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..api.interface import VoiceClonePromptItem

logger = logging.getLogger(__name__)

NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


@dataclass
class Voice:
    name: str
    prompt: VoiceClonePromptItem
    created_at: int = field(default_factory=lambda: int(time.time()))

    def info(self) -> dict:
        return {"name": self.name, "object": "voice", "created_at": self.created_at,
                "ref_text": self.prompt.ref_text, "x_vector_only_mode": self.prompt.x_vector_only_mode}


def check_name(name: str) -> str:
    """Names are case-insensitive and become file names, so they are restricted."""
    key = name.strip().lower()
    if not NAME.fullmatch(key):
        raise ValueError(f"invalid voice name {name!r}: use 1-64 letters, digits, '_', '-' or '.', "
                         "starting with a letter or digit")
    return key


class VoiceStore:
    """In memory, and mirrored to `directory` when one is given (reloaded at startup)."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.dir = Path(directory) if directory else None
        self._voices: dict[str, Voice] = {}
        self._lock = threading.Lock()
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._load_all()

    def get(self, name: str) -> Voice | None:
        return self._voices.get(name.strip().lower())

    def list(self) -> list[Voice]:
        return sorted(self._voices.values(), key=lambda v: v.name)

    def add(self, name: str, prompt: VoiceClonePromptItem) -> Voice:
        """Raises KeyError when the name is taken (delete it first)."""
        key = check_name(name)
        voice = Voice(key, prompt)
        with self._lock:
            if key in self._voices:
                raise KeyError(key)
            if self.dir is not None:
                self._save(voice)
            self._voices[key] = voice
        return voice

    def delete(self, name: str) -> bool:
        key = name.strip().lower()
        with self._lock:
            if self._voices.pop(key, None) is None:
                return False
            if self.dir is not None:
                for suffix in (".safetensors", ".json"):
                    (self.dir / f"{key}{suffix}").unlink(missing_ok=True)
        return True

    def _save(self, voice: Voice) -> None:
        p = voice.prompt
        tensors = {"ref_spk_embedding": p.ref_spk_embedding.detach().float().cpu().contiguous()}
        if p.ref_code is not None:
            tensors["ref_code"] = p.ref_code.detach().long().cpu().contiguous()
        meta = {"name": voice.name, "ref_text": p.ref_text, "x_vector_only_mode": bool(p.x_vector_only_mode),
                "icl_mode": bool(p.icl_mode), "created_at": voice.created_at}
        # tensors first, JSON last: a voice is loaded only when its JSON exists
        tmp = self.dir / f".{voice.name}.safetensors.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, self.dir / f"{voice.name}.safetensors")
        tmp = self.dir / f".{voice.name}.json.tmp"
        tmp.write_text(json.dumps(meta, ensure_ascii=False, indent=1))
        os.replace(tmp, self.dir / f"{voice.name}.json")

    def _load_all(self) -> None:
        for meta_path in sorted(self.dir.glob("*.json")):
            try:
                voice = self._load(meta_path)
            except Exception as e:  # noqa: BLE001 - one bad file must not stop the server
                logger.warning("skipping voice %s: %s", meta_path.name, e)
                continue
            self._voices[voice.name] = voice
        logger.info("loaded %d registered voices from %s", len(self._voices), self.dir)

    def _load(self, meta_path: Path) -> Voice:
        meta = json.loads(meta_path.read_text())
        name = check_name(meta_path.stem)
        tensors = load_file(str(meta_path.with_suffix(".safetensors")))
        code = tensors.get("ref_code")
        icl = bool(meta.get("icl_mode", code is not None)) and code is not None
        prompt = VoiceClonePromptItem(ref_code=code, ref_spk_embedding=tensors["ref_spk_embedding"],
                                      x_vector_only_mode=bool(meta.get("x_vector_only_mode", not icl)),
                                      icl_mode=icl, ref_text=meta.get("ref_text"))
        return Voice(name, prompt, int(meta.get("created_at", 0)))
