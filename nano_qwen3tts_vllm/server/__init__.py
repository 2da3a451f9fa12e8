"""OpenAI-compatible HTTP server: `create_app(tts, settings)`; the CLI is nano_qwen3tts_vllm.serve."""
from .app import create_app
from .settings import ServerSettings

__all__ = ["create_app", "ServerSettings"]
