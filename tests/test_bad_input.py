"""Bad input gets a clear ValueError before anything is queued, and the engine keeps serving."""
from __future__ import annotations

import base64
import warnings

import numpy as np
import pytest

from conftest import GREEDY


@pytest.fixture(scope="module")
def cv(ckpt, ours):
    return ours(ckpt("tiny-random"))


@pytest.fixture(scope="module")
def base(ckpt, ours):
    return ours(ckpt("tiny-random-base"))


def assert_idle(tts):
    eng = tts.engine.engine
    assert not eng.seqs and not eng.scheduler.waiting and not eng.scheduler.running
    bm = eng.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


OK = dict(speaker="vivian", language="english", max_new_tokens=6, **GREEDY)

CUSTOM_VOICE_CASES = [
    ("unknown speaker", dict(text="Hi.", speaker="nobody"), "unsupported speakers"),
    ("no speaker", dict(text="Hi.", speaker=""), "unsupported speakers"),
    ("unknown language", dict(text="Hi.", language="klingon"), "unsupported languages"),
    ("empty text", dict(text=""), "non-empty"),
    ("blank text", dict(text="   \n"), "non-empty"),
    ("text not a string", dict(text=[None]), "non-empty"),
    ("text over the character limit", dict(text="a" * 10001), "limit"),
    ("prompt longer than the model length", dict(text="word " * 700), "too long"),
    ("batch size mismatch", dict(text=["a", "b", "c"], speaker=["vivian", "eric"]), "batch size mismatch"),
    ("max_new_tokens zero", dict(text="Hi.", max_new_tokens=0), "max_new_tokens"),
    ("max_new_tokens negative", dict(text="Hi.", max_new_tokens=-5), "max_new_tokens"),
    ("max_new_tokens beyond capacity", dict(text="Hi.", max_new_tokens=100000), "max_new_tokens"),
    ("max_new_tokens not an integer", dict(text="Hi.", max_new_tokens=2.5), "max_new_tokens"),
    ("temperature zero while sampling", dict(text="Hi.", do_sample=True, temperature=0.0), "temperature"),
    ("top_p zero", dict(text="Hi.", top_p=0.0), "top_p"),
    ("negative top_k", dict(text="Hi.", subtalker_top_k=-1), "top_k"),
    ("negative seed", dict(text="Hi.", seed=-3), "seed"),
    ("repetition_penalty zero", dict(text="Hi.", repetition_penalty=0.0), "repetition_penalty"),
]


@pytest.mark.parametrize("case, override, match", CUSTOM_VOICE_CASES, ids=[c[0] for c in CUSTOM_VOICE_CASES])
def test_custom_voice_bad_input(cv, case, override, match):
    kw = dict(OK, **override)
    with pytest.raises(ValueError, match=match):
        cv.generate_custom_voice(**kw)
    assert_idle(cv)


def test_method_must_match_model_type(cv, base):
    with pytest.raises(ValueError, match="voice_design model"):
        cv.generate_voice_design("Hi.", instruct="calm")
    with pytest.raises(ValueError, match="base model"):
        cv.generate_voice_clone("Hi.", ref_audio=(np.zeros(24000, np.float32), 24000), x_vector_only_mode=True)
    with pytest.raises(ValueError, match="base model"):
        cv.create_voice_clone_prompt((np.zeros(24000, np.float32), 24000), x_vector_only_mode=True)
    with pytest.raises(ValueError, match="custom_voice model"):
        base.generate_custom_voice("Hi.", speaker="vivian")
    assert_idle(cv)
    assert_idle(base)


@pytest.mark.parametrize("ref_audio, match", [
    (base64.b64encode(b"definitely not audio" * 40).decode(), "not decodable"),
    ("data:audio/wav;base64," + base64.b64encode(b"RIFF....WAVEfmt garbage" * 30).decode(), "not decodable"),
    ("/no/such/file.wav", "could not read"),
    (np.zeros(100, np.float32), "tuple"),
    ((np.full(24000, np.nan, np.float32), 24000), "NaN"),
    ((np.zeros(0, np.float32), 24000), "empty"),
], ids=["random bytes", "broken data url", "missing file", "bare array", "nan samples", "empty"])
def test_bad_reference_audio(base, ref_audio, match):
    with pytest.raises(ValueError, match=match):
        base.generate_voice_clone("Hi.", ref_audio=ref_audio, x_vector_only_mode=True, max_new_tokens=4)
    assert_idle(base)


def test_icl_needs_ref_text(base, ref_wav):
    with pytest.raises(ValueError, match="ref_text is required"):
        base.generate_voice_clone("Hi.", ref_audio=ref_wav, x_vector_only_mode=False)
    with pytest.raises(ValueError, match="either voice_clone_prompt or ref_audio"):
        base.generate_voice_clone("Hi.")
    assert_idle(base)


def test_instruct_ignored_with_a_warning(ckpt, ours, base, ref_wav):
    small = ours(ckpt("tiny-random-custom-voice-0.6b"))
    with pytest.warns(UserWarning, match="instruct"):
        wavs, _ = small.generate_custom_voice("Hi.", instruct="whisper", **OK)
    plain, _ = small.generate_custom_voice("Hi.", **OK)
    np.testing.assert_array_equal(wavs[0], plain[0])
    with pytest.warns(UserWarning, match="instruct"):
        base.generate_voice_clone("Hi.", ref_audio=ref_wav, x_vector_only_mode=True, instruct="whisper",
                                  max_new_tokens=4, **GREEDY)


def test_engine_keeps_serving_after_bad_requests(cv):
    for _, override, _ in CUSTOM_VOICE_CASES[:6]:
        with pytest.raises(ValueError):
            cv.generate_custom_voice(**dict(OK, **override))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wavs, sr = cv.generate_custom_voice(["Still here.", "Me too."], **OK)
    assert sr == 24000 and [w.shape for w in wavs] == [(5 * 1920,), (5 * 1920,)]
    assert_idle(cv)
