"""Token-exact parity with qwen-tts (the reference) in fp32 greedy on tiny random checkpoints."""
from __future__ import annotations

import asyncio
import warnings

import numpy as np
import pytest
import torch

from conftest import EOS_TEXTS, GREEDY

TEXTS = ["Hello world, this is a test.", "A second, somewhat longer sentence for the batch."]


def assert_same(ref, ours, wavs_ref, wavs_ours):
    assert len(ref.codes) == len(ours.codes) == len(wavs_ref) == len(wavs_ours)
    for a, b, x, y in zip(ref.codes, ours.codes, wavs_ref, wavs_ours):
        assert a.shape == b.shape, f"frames: reference {tuple(a.shape)}, ours {tuple(b.shape)}"
        assert torch.equal(a, b)
        assert x.dtype == y.dtype == np.float32
        assert x.shape == y.shape
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-custom-voice-0.6b"])
@pytest.mark.parametrize("non_streaming_mode", [True, False])
@pytest.mark.parametrize("instruct", [None, "Speak slowly and warmly."])
def test_custom_voice(ckpt, reference, ours, name, non_streaming_mode, instruct):
    d = ckpt(name)
    ref, mine = reference(d), ours(d)
    kw = dict(speaker=["vivian", "eric"], language=["english", "auto"], instruct=instruct,
              non_streaming_mode=non_streaming_mode, max_new_tokens=24, **GREEDY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wo, sr = mine.generate_custom_voice(TEXTS, **kw)
    dropped = [w for w in caught if "instruct" in str(w.message)]
    assert bool(dropped) == bool(instruct and name.endswith("0.6b"))
    wr, sr_ref = ref.generate_custom_voice(TEXTS, **kw)
    assert sr == sr_ref == 24000
    assert_same(ref, mine, wr, wo)


@pytest.mark.parametrize("non_streaming_mode", [True, False])
@pytest.mark.parametrize("language", ["chinese", "auto", "english"])
def test_custom_voice_dialect_speaker(ckpt, reference, ours, non_streaming_mode, language):
    d = ckpt("tiny-random")
    ref, mine = reference(d), ours(d)
    kw = dict(speaker="dylan", language=language, non_streaming_mode=non_streaming_mode, max_new_tokens=12, **GREEDY)
    assert_same(ref, mine, ref.generate_custom_voice("你好，世界。", **kw)[0],
                mine.generate_custom_voice("你好，世界。", **kw)[0])


@pytest.mark.parametrize("non_streaming_mode", [True, False])
@pytest.mark.parametrize("instruct", ["", "A calm, deep voice."])
def test_voice_design(ckpt, reference, ours, non_streaming_mode, instruct):
    d = ckpt("tiny-random-voice-design")
    ref, mine = reference(d), ours(d)
    kw = dict(instruct=[instruct, "Bright and fast."], language="auto", non_streaming_mode=non_streaming_mode,
              max_new_tokens=20, **GREEDY)
    assert_same(ref, mine, ref.generate_voice_design(TEXTS, **kw)[0], mine.generate_voice_design(TEXTS, **kw)[0])


@pytest.mark.parametrize("name", ["tiny-random-base", "tiny-random-base-0.6b"])
@pytest.mark.parametrize("non_streaming_mode", [True, False])
@pytest.mark.parametrize("x_vector_only_mode", [True, False])
def test_voice_clone(ckpt, reference, ours, ref_wav, name, non_streaming_mode, x_vector_only_mode):
    d = ckpt(name)
    ref, mine = reference(d), ours(d)
    kw = dict(language="english", ref_audio=ref_wav, ref_text="A short reference transcript.",
              x_vector_only_mode=x_vector_only_mode, non_streaming_mode=non_streaming_mode, max_new_tokens=20,
              **GREEDY)
    assert_same(ref, mine, ref.generate_voice_clone(TEXTS, **kw)[0], mine.generate_voice_clone(TEXTS, **kw)[0])


def test_clips_decoded_while_generating_equal_the_reference(ckpt, reference, ours, ref_wav, monkeypatch):
    """The CUDA path for whole clips (decoded piece by piece while generated, api/clip_pipeline) forced on here:
    the same codes as qwen-tts, and its audio within the codec's fp32 tolerance, for a batch and for in-context
    voice cloning (the reference codes lead the clip, and their audio is cut). The asyncio API (which decodes on a
    worker thread) gives the same audio."""
    from nano_qwen3tts_vllm.api import interface
    from nano_qwen3tts_vllm.api.clip_pipeline import decode_while_generating
    from nano_qwen3tts_vllm.models.codec_decoder import StreamingCodecDecoder
    for name, call, kw in [
            ("tiny-random", "generate_custom_voice",
             dict(text=TEXTS, speaker=["vivian", "eric"], language="english", max_new_tokens=24)),
            ("tiny-random-base", "generate_voice_clone",
             dict(text=TEXTS[0], language="english", ref_audio=ref_wav, ref_text="A short reference transcript.",
                  max_new_tokens=20))]:
        d = ckpt(name)
        ref, mine = reference(d), ours(d)
        monkeypatch.setattr(mine, "clip_decoder", StreamingCodecDecoder(mine.speech_tokenizer.model.decoder, 1))
        wo, _ = getattr(mine, call)(**kw, **GREEDY)
        wr, _ = getattr(ref, call)(**kw, **GREEDY)
        assert len(ref.codes) == len(mine.codes) == len(wr) == len(wo)
        for a, b, x, y in zip(ref.codes, mine.codes, wr, wo):
            assert torch.equal(a, b) and x.shape == y.shape and y.dtype == np.float32
            np.testing.assert_allclose(y, x, atol=2e-4, rtol=0)
        calls = []
        monkeypatch.setattr(interface, "decode_while_generating",
                            lambda *a, **k: calls.append(1) or decode_while_generating(*a, **k))
        wa, _ = asyncio.run(getattr(mine, "a" + call)(**kw, **GREEDY))
        assert calls and len(wa) == len(wo) and all(np.array_equal(a, b) for a, b in zip(wa, wo))


def test_voice_clone_prompt_reuse(ckpt, reference, ours, ref_wav):
    """A prompt made once (by either library) serves many requests, with the same result."""
    d = ckpt("tiny-random-base")
    ref, mine = reference(d), ours(d)
    prompt_ref = ref.create_voice_clone_prompt(ref_wav, ref_text="A short reference transcript.")
    prompt_ours = mine.create_voice_clone_prompt(ref_wav, ref_text="A short reference transcript.")
    assert torch.equal(prompt_ref[0].ref_code, prompt_ours[0].ref_code)
    torch.testing.assert_close(prompt_ours[0].ref_spk_embedding, prompt_ref[0].ref_spk_embedding)
    kw = dict(language="auto", max_new_tokens=16, **GREEDY)
    wr, _ = ref.generate_voice_clone(TEXTS, voice_clone_prompt=prompt_ref, **kw)
    wo, _ = mine.generate_voice_clone(TEXTS, voice_clone_prompt=prompt_ref, **kw)
    assert_same(ref, mine, wr, wo)
    wo2, _ = mine.generate_voice_clone(TEXTS, voice_clone_prompt=prompt_ours, **kw)
    for a, b in zip(wo, wo2):
        np.testing.assert_array_equal(a, b)


def test_eos_lands_where_reference_stops(eos_ckpt, reference, ours):
    d, non_streaming_mode = eos_ckpt
    ref, mine = reference(d), ours(d)
    kw = dict(speaker=["ryan", "serena"], language="english", non_streaming_mode=non_streaming_mode,
              max_new_tokens=40, **GREEDY)
    wr, _ = ref.generate_custom_voice(EOS_TEXTS, **kw)
    wo, _ = mine.generate_custom_voice(EOS_TEXTS, **kw)
    assert_same(ref, mine, wr, wo)
    assert ref.codes[0].shape[0] <= 6, "the fixture makes the first text stop on EOS by step 6"


def test_length_limit_gives_n_minus_one_frames(ckpt, reference, ours):
    d = ckpt("tiny-random")
    ref, mine = reference(d), ours(d)
    kw = dict(speaker="aiden", language="english", max_new_tokens=9, **GREEDY)
    wr, _ = ref.generate_custom_voice("Count the frames.", **kw)
    wo, _ = mine.generate_custom_voice("Count the frames.", **kw)
    assert_same(ref, mine, wr, wo)
    assert mine.codes[0].shape == (8, 16)
    assert wo[0].shape == (8 * 1920,)



def test_teacher_forced_logits(ckpt, reference, ours):
    """Same inputs at every step (the greedy codes agree), so every logit vector is compared."""
    d = ckpt("tiny-random")
    ref, mine = reference(d), ours(d)
    got_ref, got_ours = [], []
    hooks = [ref.model.model.talker.codec_head.register_forward_hook(
        lambda m, i, o: got_ref.append(o[0, -1].detach().float().clone()))]
    for head in ref.model.model.talker.code_predictor.lm_head:
        hooks.append(head.register_forward_hook(lambda m, i, o: got_ref.append(o[0, -1].detach().float().clone())))
    engine = mine.engine.engine
    hooks.append(engine.executor.talker.model.codec_head.register_forward_hook(
        lambda m, i, o: got_ours.append(o[0].detach().float().clone())))
    predictor = engine.executor.predictor.model
    original = predictor.logits

    def recording_logits(h, residual, step):
        out = original(h, residual, step)
        got_ours.append(out[0].detach().float().clone())
        return out
    predictor.logits = recording_logits
    try:
        kw = dict(speaker="vivian", language="english", max_new_tokens=16, **GREEDY)
        ref.generate_custom_voice("Teacher forcing, step by step.", **kw)
        mine.generate_custom_voice("Teacher forcing, step by step.", **kw)
    finally:
        for h in hooks:
            h.remove()
        del predictor.logits
    assert torch.equal(ref.codes[0], mine.codes[0])
    assert len(got_ref) == len(got_ours) == 16 + 15 * 15  # 16 talker steps, 15 frames of 15 predictor steps
    worst = max(float((a - b).abs().max()) for a, b in zip(got_ref, got_ours))
    assert worst < 1e-4, f"largest logit difference {worst}"
