"""Request bodies of the speech API: OpenAI's fields plus the Qwen3-TTS extensions."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

TASK_TYPES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
RESPONSE_FORMATS = ("pcm", "wav", "flac", "mp3", "opus")
STREAMABLE_FORMATS = ("pcm", "wav")


class SpeechRequest(BaseModel):
    """POST /v1/audio/speech. Unknown fields are refused, so a misspelt option is an error, not a no-op."""
    model_config = ConfigDict(extra="forbid")

    # OpenAI
    input: str
    model: str | None = None
    voice: str | None = None
    instructions: str | None = None
    response_format: str | None = None    # default mp3, as OpenAI (pcm for SSE)
    stream_format: str | None = None      # "audio" (default) or "sse"
    speed: float | None = None
    # Qwen3-TTS extensions
    stream: bool | None = None            # False: pcm/wav too are sent whole, with a Content-Length
    task_type: str | None = None
    language: str | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool = False
    non_streaming_mode: bool | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None      # 0: greedy for talker and code predictor
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    subtalker_temperature: float | None = None
    subtalker_top_k: int | None = None
    subtalker_top_p: float | None = None
    seed: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy_body(cls, data: Any) -> Any:
        """The older {"text", "speaker", "instruct"} body maps onto input/voice/instructions."""
        if isinstance(data, dict):
            data = dict(data)
            for old, new in (("text", "input"), ("speaker", "voice"), ("instruct", "instructions")):
                if old in data and new not in data:
                    data[new] = data.pop(old)
        return data

    def generation_kwargs(self) -> dict:
        """The interface's generation keywords (qwen-tts names); None leaves the model's default."""
        gen = dict(max_new_tokens=self.max_new_tokens, top_k=self.top_k, top_p=self.top_p,
                   repetition_penalty=self.repetition_penalty, seed=self.seed,
                   subtalker_top_k=self.subtalker_top_k, subtalker_top_p=self.subtalker_top_p,
                   subtalker_temperature=self.subtalker_temperature)
        if self.temperature == 0:
            gen.update(do_sample=False, subtalker_dosample=False)
        elif self.temperature is not None:
            gen["temperature"] = self.temperature
            if self.subtalker_temperature is None:
                gen["subtalker_temperature"] = self.temperature
        return {k: v for k, v in gen.items() if v is not None}
