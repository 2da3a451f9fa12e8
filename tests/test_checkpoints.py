"""Random-weight checkpoints: the reference (qwen-tts) loads and runs them; builds are deterministic and cached."""
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from nano_qwen3tts_vllm import checkpoints as ck

MAX_NEW = 8
GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=MAX_NEW)
TEXT = "Hello world."


@pytest.fixture(scope="session", autouse=True)
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("nano-qwen3tts-cache")
        mp.setenv("NANO_QWEN3TTS_CACHE", str(path))
        yield path


def load_reference(name: str):
    from qwen_tts import Qwen3TTSModel

    return Qwen3TTSModel.from_pretrained(ck.resolve_model(name), dtype=torch.float32)


def check_audio(wavs, sr, frames):
    assert sr == 24000 and len(wavs) == 1
    wav = wavs[0]
    assert wav.dtype == np.float32 and wav.shape == (frames * 1920,)
    assert np.isfinite(wav).all() and wav.std() > 1e-3


@pytest.mark.parametrize("name", ["tiny-random-custom-voice", "tiny-random-voice-design", "tiny-random-base",
                                  "tiny-random-base-0.6b"])
def test_reference_loads_and_generates(name):
    tts = load_reference(name)
    model_type = tts.model.tts_model_type
    if model_type == "custom_voice":
        out = tts.generate_custom_voice(TEXT, speaker="vivian", language="english", **GREEDY)
    elif model_type == "voice_design":
        out = tts.generate_voice_design(TEXT, instruct="a calm voice", language="english", **GREEDY)
    else:
        t = np.arange(36000) / 24000
        ref = ((0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t)).astype(np.float32), 24000)
        check_audio(*tts.generate_voice_clone(TEXT, language="english", ref_audio=ref, x_vector_only_mode=True,
                                              **GREEDY), frames=MAX_NEW - 1)
        out = tts.generate_voice_clone(TEXT, language="english", ref_audio=ref, ref_text="A short reference.",
                                       x_vector_only_mode=False, **GREEDY)
    # No EOS within MAX_NEW steps: N talker steps give N-1 frames.
    check_audio(*out, frames=MAX_NEW - 1)


def test_codec_decodes_distinct_audio():
    codec = load_reference("tiny-random").model.speech_tokenizer
    gen = torch.Generator().manual_seed(1)
    codes = [torch.randint(0, 2048, (10, 16), generator=gen) for _ in range(2)]
    (a, b), sr = codec.decode([{"audio_codes": c} for c in codes])
    for w in (a, b):
        assert w.shape == (10 * 1920,) and np.isfinite(w).all()
        assert 0.02 < w.std() < 0.9 and np.mean(np.abs(w) > 0.999) < 0.05  # audible, mostly unclipped
    assert np.abs(a - b).mean() > 0.01
    enc = codec.encode(a, sr=sr).audio_codes[0]
    assert enc.shape == (10, 16) and 0 <= int(enc.min()) and int(enc.max()) < 2048


def test_predictor_flavours():
    for name, size, has_projection in [("tiny-random", "1b7", True), ("tiny-random-0.6b", "0b6", False)]:
        path = Path(ck.resolve_model(name))
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["tts_model_size"] == size and cfg["transformers_version"] == "4.57.1"
        assert "model_type" not in cfg["speaker_encoder_config"]
        talker = cfg["talker_config"]
        assert (talker["hidden_size"] != talker["code_predictor_config"]["hidden_size"]) == has_projection
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        proj = {"talker.code_predictor.small_to_mtp_projection.weight",
                "talker.code_predictor.small_to_mtp_projection.bias"}
        assert (proj <= keys) == has_projection
        assert not any(k.startswith("speaker_encoder.") for k in keys)  # custom voice: no speaker encoder
    with safe_open(ck.resolve_model("tiny-random-base") + "/model.safetensors", "pt") as f:
        assert any(k.startswith("speaker_encoder.") for k in f.keys())


def test_build_is_deterministic(tmp_path):
    def weights(seed, name):
        out = ck.build_random_checkpoint(tmp_path / name, "base", seed=seed)
        return [(out / f).read_bytes() for f in ("model.safetensors", "speech_tokenizer/model.safetensors")]

    a, b, c = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert a == b
    assert a[0] != c[0] and a[1] != c[1]


def test_tokenizer_ids():
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSProcessor
    from transformers import AutoConfig, AutoProcessor, Qwen2TokenizerFast

    path = ck.resolve_model("tiny-random")
    plain = Qwen2TokenizerFast.from_pretrained(path)
    ids = lambda s: plain(s)["input_ids"]
    assert ids("assistant") == [77091] and ids("\n") == [198] and ids("<|im_start|>") == [151644]
    assert ids("<|im_end|><tts_pad><tts_text_bos><tts_text_eod>") == [151645, 151671, 151672, 151673]
    # As Qwen3TTSModel.from_pretrained loads it; "HelloWorld" would split under the "fixed" Mistral regex.
    AutoConfig.register("qwen3_tts", Qwen3TTSConfig, exist_ok=True)
    AutoProcessor.register(Qwen3TTSConfig, Qwen3TTSProcessor, exist_ok=True)
    processor = AutoProcessor.from_pretrained(path, fix_mistral_regex=True)
    for text in ["Hello world.", "HelloWorld iPhone 12345 don't\n\nstop!", "你好，世界。"]:
        prompt = f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
        assert processor(text=prompt)["input_ids"][0] == ids(prompt)
    assert ids("<|im_start|>assistant\nHello world.<|im_end|>\n<|im_start|>assistant\n") == [
        151644, 77091, 198, 9707, 1879, 13, 151645, 198, 151644, 77091, 198]


def test_fixed_length_runs_to_max_new_tokens():
    normal, fixed = load_reference("tiny-random"), load_reference("tiny-random-fixed")
    assert fixed.model.config.talker_config.codec_eos_token_id == 3072
    names = ("tiny-random", "tiny-random-fixed")
    weights = [Path(ck.resolve_model(n), "model.safetensors").read_bytes() for n in names]
    assert weights[0] == weights[1]  # only the config differs

    def codes(tts):
        ids = tts._tokenize_texts([tts._build_assistant_text(TEXT)])
        out, _ = tts.model.generate(input_ids=ids, languages=["english"], speakers=["vivian"], non_streaming_mode=True,
                                    do_sample=False, subtalker_dosample=False, max_new_tokens=12)
        return out[0]

    for tts in (normal, fixed):  # make the real EOS (2150) the talker's clear favourite
        tts.model.talker.codec_head.register_forward_hook(lambda m, i, o: o.index_add_(
            -1, torch.tensor([2150]), torch.full_like(o[..., :1], 1e3)))
    assert codes(normal).shape[0] == 2  # min_new_tokens=2, then EOS
    assert codes(fixed).shape == (11, 16)  # EOS suppressed: 12 steps, 11 frames


def test_resolve_model(tmp_path):
    assert ck.resolve_model(str(tmp_path)) == str(tmp_path)
    assert ck.resolve_model("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice") == "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
    path = ck.resolve_model("tiny-random-voice-design")
    assert json.loads(Path(path, "config.json").read_text())["tts_model_type"] == "voice_design"
    mtime = Path(path, "model.safetensors").stat().st_mtime_ns
    assert ck.resolve_model("tiny-random-voice-design") == path  # cached, not rebuilt
    assert Path(path, "model.safetensors").stat().st_mtime_ns == mtime
    assert ck.resolve_model("tiny-random") == ck.resolve_model("tiny-random-custom-voice")
    assert ck.resolve_model(path) == path
    for bad in ("tiny-random-xxx", "tiny-random-base-3b", "random-7b-base"):
        with pytest.raises(ValueError, match="valid names: tiny-random, tiny-random-0.6b, tiny-random-custom-voice"):
            ck.resolve_model(bad)
    for name in ck.builtin_names():
        assert ck._parse_name(name) is not None


def test_build_once_is_exclusive(tmp_path):
    calls = []

    def slow_build(tmp):
        calls.append(tmp)
        time.sleep(0.3)
        (tmp / "done").write_text("ok")

    threads = [threading.Thread(target=ck._build_once, args=(tmp_path / "x", slow_build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (tmp_path / "x" / "done").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".x.lock")] == ["x"]  # no temp dirs left


@pytest.mark.parametrize("size", ["0.6b", "1.7b"])
def test_full_size_configs(size):
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration

    hidden, inter = {"0.6b": (1024, 3072), "1.7b": (2048, 6144)}[size]
    for model_type in ck.MODEL_TYPES:
        cfg = ck.make_config(model_type, size)
        t, p = cfg.talker_config, cfg.talker_config.code_predictor_config
        assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads,
                t.num_key_value_heads, t.head_dim) == (hidden, inter, 28, 16, 8, 128)
        assert (t.text_hidden_size, t.text_vocab_size, t.vocab_size, t.rope_theta) == (2048, 151936, 3072, 1000000)
        assert t.rope_scaling["mrope_section"] == [24, 20, 20] and t.rope_scaling["interleaved"]
        assert (p.hidden_size, p.intermediate_size, p.num_hidden_layers, p.num_attention_heads,
                p.num_key_value_heads, p.head_dim) == (1024, 3072, 5, 16, 8, 128)
        assert (p.vocab_size, p.num_code_groups) == (2048, 16)
        assert cfg.tts_model_size == {"0.6b": "0b6", "1.7b": "1b7"}[size] and cfg.tts_model_type == model_type
        assert cfg.speaker_encoder_config.enc_dim == hidden
        assert (t.codec_eos_token_id, t.codec_pad_id, t.codec_bos_id) == (2150, 2148, 2149)
        assert bool(t.spk_id) == (model_type == "custom_voice")
    with torch.device("meta"):
        model = Qwen3TTSForConditionalGeneration(ck.make_config("base", size))
    proj = model.talker.code_predictor.small_to_mtp_projection
    assert isinstance(proj, torch.nn.Identity) == (size == "0.6b")
    d = ck.make_codec_config(size).decoder_config
    assert (d.codebook_dim, d.latent_dim, d.hidden_size, d.intermediate_size) == (512, 1024, 512, 1024)
    assert (d.num_hidden_layers, d.num_attention_heads, d.head_dim) == (8, 16, 64)
    assert (d.decoder_dim, d.sliding_window, d.num_quantizers, d.codebook_size) == (1536, 72, 16, 2048)
    assert list(d.upsample_rates) == [8, 5, 4, 3] and list(d.upsampling_ratios) == [2, 2]
