"""nano-qwen3tts-vllm: a nano-vLLM-style serving engine for Qwen3-TTS."""
from .api.interface import Qwen3TTSInterface, TTSRequest, VoiceClonePromptItem
from .config import EngineConfig
from .sampling_params import SamplingParams

__all__ = ["Qwen3TTSInterface", "TTSRequest", "VoiceClonePromptItem", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"
