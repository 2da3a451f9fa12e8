"""Model facts read from a checkpoint's config.json, and the engine's own settings."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class DecoderConfig:
    """One Qwen3 decoder stack (the talker's or the code predictor's)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", 10000.0),
        )


@dataclass
class ModelConfig:
    """What the engine needs to know about a Qwen3-TTS 12Hz checkpoint."""
    talker: DecoderConfig
    predictor: DecoderConfig
    model_type: str                # custom_voice | voice_design | base
    model_size: str                # "0b6" | "1b7" (as upstream writes it)
    codec_vocab_size: int          # 3072: talker codec embedding / head
    predictor_vocab_size: int      # 2048: each residual codebook
    num_code_groups: int           # 16
    text_vocab_size: int
    text_hidden_size: int
    # text-side special ids
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int
    # codec-side special ids
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speaker_ids: dict[str, int] = field(default_factory=dict)
    speaker_dialects: dict[str, str | bool] = field(default_factory=dict)
    language_ids: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a Qwen3-TTS checkpoint directory needs a config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if d.get("model_type") != "qwen3_tts":
            raise ValueError(f"config.json has model_type={d.get('model_type')!r}; expected 'qwen3_tts'")
        if d.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
            raise ValueError(f"tokenizer_type {d.get('tokenizer_type')!r} is not supported; only the 12Hz models are")
        t = d["talker_config"]
        p = t["code_predictor_config"]
        return cls(
            talker=DecoderConfig.from_dict(t),
            predictor=DecoderConfig.from_dict(p),
            model_type=d["tts_model_type"],
            model_size=d.get("tts_model_size") or "",
            codec_vocab_size=t["vocab_size"],
            predictor_vocab_size=p["vocab_size"],
            num_code_groups=t["num_code_groups"],
            text_vocab_size=t["text_vocab_size"],
            text_hidden_size=t["text_hidden_size"],
            tts_pad_id=d.get("tts_pad_token_id", 151671),
            tts_bos_id=d.get("tts_bos_token_id", 151672),
            tts_eos_id=d.get("tts_eos_token_id", 151673),
            codec_pad_id=t["codec_pad_id"],
            codec_bos_id=t["codec_bos_id"],
            codec_eos_id=t["codec_eos_token_id"],
            codec_think_id=t["codec_think_id"],
            codec_nothink_id=t["codec_nothink_id"],
            codec_think_bos_id=t["codec_think_bos_id"],
            codec_think_eos_id=t["codec_think_eos_id"],
            speaker_ids={k.lower(): _codec_id(v) for k, v in (t.get("spk_id") or {}).items()},
            speaker_dialects={k.lower(): v for k, v in (t.get("spk_is_dialect") or {}).items()},
            language_ids={k.lower(): _codec_id(v) for k, v in (t.get("codec_language_id") or {}).items()},
        )

    @property
    def suppressed_ids(self) -> list[int]:
        """Talker ids never sampled: the top 1024 (control ids) except EOS, as upstream."""
        v = self.codec_vocab_size
        return [i for i in range(v - 1024, v) if i != self.codec_eos_id]

    @property
    def supported_languages(self) -> list[str]:
        return ["auto"] + [k for k in self.language_ids if "dialect" not in k]


def _codec_id(v) -> int:
    """Configs store a codec id as an int or as a one-element list."""
    if isinstance(v, (list, tuple)):
        if len(v) != 1:
            raise ValueError(f"expected one codec id, got {v}")
        v = v[0]
    return int(v)


@dataclass
class EngineConfig:
    """Engine settings (the vLLM names where there is one)."""
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096          # prompt positions + frames per sequence
    kvcache_block_size: int = 16
    num_kvcache_blocks: int = -1       # -1: derive from gpu_memory_utilization (CUDA) or max_num_seqs (CPU)
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"    # auto | torch | triton | flash
    async_scheduling: bool = True      # launch decode step t+1 before reading step t (in-process executor only)

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kvcache_block_size < 1:
            raise ValueError(f"kvcache_block_size must be >= 1, got {self.kvcache_block_size}")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens must be >= max_model_len so any single prompt fits in one prefill")
        if self.attention_backend not in ("auto", "torch", "triton", "flash"):
            raise ValueError(f"attention_backend must be auto, torch, triton or flash; got {self.attention_backend!r}")
