"""GPU checks (the Triton kernels have their own files): fp32 parity with CUDA graphs on, valid bf16 output.
Skipped without CUDA; run them on the GPU machine (see README)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import GREEDY, Reference, record_codes, record_decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TEXTS = ["Hello world, this is a GPU test.", "A second, somewhat longer sentence for the batch.", "Third."]


@pytest.fixture(scope="module")
def gpu_models(ckpt):
    from nano_qwen3tts_vllm import Qwen3TTSInterface
    made = {}

    def get(name, dtype=torch.float32):
        key = (name, dtype)
        if key not in made:
            m = Qwen3TTSInterface.from_pretrained(ckpt(name), device="cuda", dtype=dtype, max_num_seqs=8,
                                                  max_model_len=512, enforce_eager=False,
                                                  num_kvcache_blocks=1024)
            record_codes(m)
            made[key] = m
        return made[key]
    yield get
    for m in made.values():
        m.close()


def gpu_reference(model_dir):
    from qwen_tts import Qwen3TTSModel
    ref = Reference.__new__(Reference)
    ref.model = Qwen3TTSModel.from_pretrained(model_dir, dtype=torch.float32, device_map="cuda")
    record_decode(ref, ref.model.model.speech_tokenizer)
    return ref


@pytest.fixture
def no_tf32():
    """True fp32 convolutions: cuDNN rounds fp32 inputs to TF32 by default, and the codec's conv stack amplifies
    that (max abs ~0.02 between two algorithms on the full-size random codec); without it ours and the
    reference's decode differ by float rounding, as on CPU."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-voice-design", "tiny-random-base"])
def test_fp32_parity_with_cuda_graphs(ckpt, gpu_models, ref_wav, name, no_tf32):
    mine = gpu_models(name)
    executor = mine.engine.engine.executor
    assert executor.talker.graphs is not None and executor.predictor.graphs is not None
    ref = gpu_reference(ckpt(name))
    for nsm in (True, False):
        kw = dict(language="english", non_streaming_mode=nsm, max_new_tokens=32, **GREEDY)
        if name == "tiny-random":
            call = lambda m: m.generate_custom_voice(TEXTS, speaker=["vivian", "eric", "ryan"], **kw)
        elif name == "tiny-random-voice-design":
            call = lambda m: m.generate_voice_design(TEXTS, instruct="A calm voice.", **kw)
        else:
            call = lambda m: m.generate_voice_clone(TEXTS, ref_audio=ref_wav, ref_text="A reference.", **kw)
        wr, _ = call(ref)
        wo, _ = call(mine)
        for a, b, x, y in zip(ref.codes, mine.codes, wr, wo):
            assert torch.equal(a.cpu(), b.cpu()), (name, nsm)
            np.testing.assert_allclose(y, x, atol=2e-4)  # the codec tests' fp32 tolerance


def test_bf16_codes_valid_and_seeded_requests_repeat(gpu_models):
    mine = gpu_models("tiny-random", torch.bfloat16)
    kw = dict(speaker="vivian", language="english", max_new_tokens=40, seed=3)
    wavs, sr = mine.generate_custom_voice(TEXTS, **kw)
    for codes, wav in zip(mine.codes, wavs):
        assert codes.shape[1] == 16 and codes.shape[0] >= 1
        assert int(codes[:, 0].max()) < 2048 and int(codes.min()) >= 0 and int(codes[:, 1:].max()) < 2048
        assert wav.dtype == np.float32 and np.isfinite(wav).all() and wav.shape == (codes.shape[0] * 1920,)
    batched = mine.codes
    mine.generate_custom_voice(TEXTS, **kw)
    assert all(torch.equal(a, b) for a, b in zip(mine.codes, batched))
    # alone, a request's bf16 steps take the one-row GEMV kernel rather than cuBLAS (layers/triton_linear): its
    # logits round differently than in the batch, so only a repeat of the same request is compared
    for t in TEXTS[:2]:
        wav = mine.generate_custom_voice(t, **kw)[0][0]
        codes = mine.codes[0]
        np.testing.assert_array_equal(mine.generate_custom_voice(t, **kw)[0][0], wav)
        assert torch.equal(mine.codes[0], codes)


def test_fp32_seeded_sampling_is_batch_invariant(gpu_models):
    """The sampler's noise is counter-based: a seeded request draws the same numbers alone or in a batch, so in
    fp32 (where the kernels' other summation orders stay far below the sampler's margins) it gives the same codes."""
    mine = gpu_models("tiny-random")
    kw = dict(speaker="vivian", language="english", max_new_tokens=40, seed=3)
    mine.generate_custom_voice(TEXTS, **kw)
    batched = mine.codes
    for t, codes in zip(TEXTS, batched):
        mine.generate_custom_voice(t, **kw)
        assert torch.equal(mine.codes[0], codes)


def test_asyncio_whole_clips_equal_sync_on_cuda(gpu_models):
    """agenerate_* decodes while generating on a worker thread (the CUDA clip pipeline): the same audio as
    generate_*, for two calls at once."""
    import asyncio
    mine = gpu_models("tiny-random")
    assert mine.clip_decoder is not None
    kw = dict(speaker="vivian", language="english", max_new_tokens=40, **GREEDY)
    sync = [mine.generate_custom_voice(t, **kw)[0][0] for t in TEXTS[:2]]

    async def go():
        return await asyncio.gather(*(mine.agenerate_custom_voice(t, **kw) for t in TEXTS[:2]))
    got = [wavs[0] for wavs, _ in asyncio.run(go())]
    assert all(np.array_equal(a, b) for a, b in zip(got, sync))


def test_graph_and_eager_agree_fp32(ckpt):
    from nano_qwen3tts_vllm.config import EngineConfig
    from nano_qwen3tts_vllm.engine.llm_engine import LLMEngine
    from nano_qwen3tts_vllm import Qwen3TTSInterface
    d = ckpt("tiny-random")
    tts = Qwen3TTSInterface.from_pretrained(d, device="cpu", dtype=torch.float32, max_num_seqs=4, max_model_len=256)
    jobs = tts._custom_voice_jobs(TEXTS, "serena", "english", None, True, dict(max_new_tokens=30, seed=11))
    tts.close()
    frames = {}
    for eager in (True, False):
        eng = LLMEngine(d, EngineConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=512, num_kvcache_blocks=256,
                                        enforce_eager=eager), device="cuda", dtype=torch.float32)
        frames[eager] = eng.generate([j.prompt for j in jobs], [dataclasses.replace(j.params) for j in jobs])
    assert frames[True] == frames[False]


def test_multiprocess_workers_on_gpu_match_in_process(ckpt, gpu_models):
    """The serving layout (talker and predictor processes, CUDA graphs in both) gives the same codes."""
    from nano_qwen3tts_vllm import Qwen3TTSInterface
    local = gpu_models("tiny-random")
    mp_tts = Qwen3TTSInterface.from_pretrained(ckpt("tiny-random"), device="cuda", dtype=torch.float32, max_num_seqs=8,
                                               max_model_len=512, num_kvcache_blocks=1024, multiprocess=True)
    record_codes(mp_tts)
    try:
        for kw in (GREEDY, dict(seed=9)):
            a, _ = local.generate_custom_voice(TEXTS, speaker="vivian", language="english", max_new_tokens=30, **kw)
            b, _ = mp_tts.generate_custom_voice(TEXTS, speaker="vivian", language="english", max_new_tokens=30, **kw)
            for x, y in zip(local.codes, mp_tts.codes):
                assert torch.equal(x.cpu(), y.cpu())
    finally:
        mp_tts.close()
