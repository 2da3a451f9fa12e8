"""Settings of the HTTP server (the engine's own settings live in config.EngineConfig)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=lambda: ["nano-qwen3tts"])
    api_key: str | None = None
    voices_dir: str | None = None          # None: registered voices live in memory only
    max_queue: int | None = None           # requests in flight before 429; None: 4 x max_num_seqs
    allow_remote_audio: bool = False       # ref_audio as an http(s) URL
    allow_local_audio: bool = False        # ref_audio as a server-side path or file:// URL
    max_input_chars: int = 4096
    max_ref_audio_bytes: int = 10 * 1024 * 1024
    max_ref_audio_seconds: float = 60.0
    chunk_size: int = 12                   # frames per streamed chunk (12 frames = 0.96 s)
    first_chunk_size: int = 3              # small first chunk: first bytes leave fast

    def __post_init__(self):
        if not self.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.chunk_size < 1 or self.first_chunk_size < 1:
            raise ValueError("chunk_size and first_chunk_size must be >= 1")
