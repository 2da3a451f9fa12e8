"""Shared fixtures: tiny random checkpoints, the qwen-tts reference, and our interface (CPU, fp32)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU (before any kernel is defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_triton_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a tensor loop bound into an int with int(<1-element ndarray>), which
    numpy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python scalars", triton#9171), so
    `for i in range(0, tl.load(p), N)` fails on CPU although it compiles fine. Re-register __index__ after
    the interpreter's own patching so the kernels run unchanged in both modes."""
    try:
        from triton.runtime import interpreter
        original = interpreter._patch_lang_tensor
    except (ImportError, AttributeError):  # no triton, or an interpreter laid out differently
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = patch_lang_tensor


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_triton_interpreter_loop_bounds()
from safetensors.torch import load_file, save_file

from nano_qwen3tts_vllm.checkpoints import resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the hub: every model is built locally

GREEDY = dict(do_sample=False, subtalker_dosample=False)


def record_decode(owner, speech_tokenizer) -> None:
    """Make `owner.codes` hold the codes of the last speech_tokenizer.decode call."""
    decode = speech_tokenizer.decode
    owner.codes = []

    def recording_decode(items):
        owner.codes = [torch.as_tensor(e["audio_codes"]).clone() for e in items]
        return decode(items)
    speech_tokenizer.decode = recording_decode


def record_codes(tts) -> None:
    """Make `tts.codes` (a Qwen3TTSInterface) hold the whole clips of its last generate_* call (every path, decoded
    after generation or while generating, ends in _finish)."""
    finish = tts._finish
    tts.codes = []

    def recording(jobs, codes, wavs):
        tts.codes = [c.clone() for c in codes]
        return finish(jobs, codes, wavs)
    tts._finish = recording


class Reference:
    """qwen-tts on CPU in fp32, recording the codes it hands to its speech tokenizer."""

    def __init__(self, model_dir: str):
        from qwen_tts import Qwen3TTSModel
        self.model = Qwen3TTSModel.from_pretrained(model_dir, dtype=torch.float32)
        record_decode(self, self.model.model.speech_tokenizer)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture(scope="session")
def ckpt():
    return lambda name: resolve_model(name)


@pytest.fixture(scope="session", params=[True, False], ids=["non_streaming", "streaming"])
def eos_ckpt(request, tmp_path_factory):
    """(checkpoint dir, non_streaming_mode): a tiny CustomVoice checkpoint whose EOS row is set so that,
    for the first text below, EOS wins at the latest by codebook-0 step 6 in that mode."""
    src = Path(resolve_model("tiny-random"))
    dst = tmp_path_factory.mktemp("eos") / "tiny-random-eos"
    shutil.copytree(src, dst)
    ref = Reference(str(dst))
    hidden = []
    hook = ref.model.model.talker.codec_head.register_forward_hook(lambda m, i, o: hidden.append((i[0][0, -1], o[0, -1])))
    ref.generate_custom_voice(EOS_TEXTS[0], speaker="ryan", language="english", max_new_tokens=8,
                              non_streaming_mode=request.param, **GREEDY)
    hook.remove()
    h, logits = hidden[6]
    weights = load_file(dst / "model.safetensors")
    weights["talker.codec_head.weight"][2150] = h * (logits.max() + 2.0) / h.dot(h)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst), request.param


EOS_TEXTS = ["Where does it stop?", "Somewhere else, perhaps later on."]


_refs: dict[str, Reference] = {}
_ours: dict[str, object] = {}


@pytest.fixture(scope="session")
def reference():
    def get(model_dir: str) -> Reference:
        if model_dir not in _refs:
            _refs[model_dir] = Reference(model_dir)
        return _refs[model_dir]
    return get


@pytest.fixture(scope="session")
def ours():
    from nano_qwen3tts_vllm import Qwen3TTSInterface

    def get(model_dir: str, **kw):
        key = (model_dir, tuple(sorted(kw.items())))
        if key not in _ours:
            m = Qwen3TTSInterface.from_pretrained(model_dir, device="cpu", dtype=torch.float32,
                                                  max_num_seqs=8, max_model_len=512, **kw)
            record_codes(m)
            _ours[key] = m
        return _ours[key]
    yield get
    for m in _ours.values():
        m.close()
    _ours.clear()


@pytest.fixture(scope="session")
def ref_wav():
    """2 s of a synthetic voice-like signal at 24 kHz."""
    t = np.arange(48000) / 24000
    rng = np.random.default_rng(0)
    wav = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)) + 0.02 * rng.standard_normal(t.size)
    return wav.astype(np.float32), 24000

