"""Streaming generators, asyncio variants, and many threads sharing one instance."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest

from conftest import GREEDY

KW = dict(speaker="vivian", language="english", max_new_tokens=40, **GREEDY)


@pytest.fixture(scope="module")
def cv(ckpt, ours):
    return ours(ckpt("tiny-random"))


# Streaming is exact (tests/test_codec_decoder.py: 1e-13 in float64); in float32 this tiny random codec's
# own rounding noise is ~5e-5 (the reference differs from itself by that much on a prefix).
FP32_ATOL = 2e-4


def assert_same_audio(ref: np.ndarray, x: np.ndarray) -> None:
    assert ref.shape == x.shape
    assert np.abs(ref - x).max() < FP32_ATOL, np.abs(ref - x).max()


def test_stream_chunks_join_to_the_one_shot_audio(cv):
    text = "Streaming audio arrives in chunks as the frames are produced."
    full, _ = cv.generate_custom_voice(text, **KW)
    chunks = list(cv.generate_custom_voice_streaming(text, chunk_size=8, first_chunk_size=2, **KW))
    assert [c.shape[0] for c in chunks[:2]] == [2 * 1920, 8 * 1920]
    assert all(c.dtype == np.float32 for c in chunks)
    audio = np.concatenate(chunks)
    assert audio.shape == full[0].shape == (39 * 1920,)
    assert_same_audio(full[0], audio)


def test_long_stream_equals_the_one_shot_audio(cv):
    """Far past the decoder's 72-frame attention window (8 layers deep, and the conv stack's own reach):
    the stateful decoder carries all of it, so the chunks equal the one-shot decode (windowed decoding
    with 72 frames of context was 28.3 dB here)."""
    kw = dict(KW, max_new_tokens=200)
    text = "A long sentence to measure how well streamed chunks join together."
    full, _ = cv.generate_custom_voice(text, **kw)
    chunks = list(cv.generate_custom_voice_streaming(text, chunk_size=12, first_chunk_size=3, **kw))
    assert [c.shape[0] // 1920 for c in chunks] == [3] + [12] * 16 + [4]
    audio = np.concatenate(chunks)
    assert audio.shape == full[0].shape == (199 * 1920,)
    assert_same_audio(full[0], audio)


def test_voice_clone_stream_skips_reference_audio(ckpt, ours, ref_wav):
    base = ours(ckpt("tiny-random-base"))
    kw = dict(language="english", ref_audio=ref_wav, ref_text="A reference.", max_new_tokens=20, **GREEDY)
    full, _ = base.generate_voice_clone("Cloned and streamed.", **kw)
    audio = np.concatenate(list(base.generate_voice_clone_streaming("Cloned and streamed.", chunk_size=5, **kw)))
    # one-shot ICL decoding cuts the reference off proportionally; streaming never emits it
    assert abs(audio.shape[0] - full[0].shape[0]) <= 1920
    n = min(audio.shape[0], full[0].shape[0])
    assert_same_audio(full[0][-n:], audio[-n:])


def test_closing_a_stream_aborts_the_request(cv):
    gen = cv.generate_custom_voice_streaming("Stop me early.", chunk_size=2, first_chunk_size=1,
                                             speaker="vivian", language="english", max_new_tokens=200,
                                             seed=0)  # seeded: no early EOS
    first = next(gen)
    assert first.shape == (1920,)
    gen.close()
    eng = cv.engine.engine
    for _ in range(100):  # the abort is applied by the engine thread
        if not eng.has_unfinished():
            break
        threading.Event().wait(0.05)
    assert not eng.has_unfinished()
    bm = eng.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert cv.codecs.slots.in_use() == 0  # its decoder slot is free again


def test_asyncio_variants_match_sync(cv):
    texts = ["Async one.", "Async two, a little longer."]
    sync, _ = cv.generate_custom_voice(texts, **KW)

    async def go():
        batch = cv.agenerate_custom_voice(texts, **KW)
        streamed = [c async for c in cv.agenerate_custom_voice_streaming(texts[1], chunk_size=7, **KW)]
        return await batch, streamed
    (wavs, sr), streamed = asyncio.run(go())
    for a, b in zip(sync, wavs):
        np.testing.assert_array_equal(a, b)
    assert_same_audio(sync[1], np.concatenate(streamed))


@pytest.mark.parametrize("clip_pipeline", [False, True])  # True: the CUDA path (decoding on a worker thread)
def test_cancelling_an_asyncio_call_aborts_its_requests(cv, clip_pipeline, monkeypatch):
    from nano_qwen3tts_vllm.models.codec_decoder import StreamingCodecDecoder
    if clip_pipeline:
        monkeypatch.setattr(cv, "clip_decoder", StreamingCodecDecoder(cv.speech_tokenizer.model.decoder, 1))
    eng = cv.engine.engine

    async def go():
        task = asyncio.ensure_future(cv.agenerate_custom_voice(["Cancel me.", "And me."], speaker="vivian",
                                                               language="english", max_new_tokens=480,
                                                               min_new_tokens=480))
        for _ in range(200):  # until both are generating
            await asyncio.sleep(0.02)
            if len(eng.scheduler.running) == 2:
                break
        assert len(eng.scheduler.running) == 2 and not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the abort is applied by the engine thread (here, not after asyncio.run has waited
            if not eng.has_unfinished():  # for the decoding thread)
                break
            await asyncio.sleep(0.05)
        assert not eng.has_unfinished()
    asyncio.run(go())
    bm = eng.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_many_threads_share_one_instance(cv):
    texts = [f"Thread number {i} says hello." for i in range(10)]
    alone = {t: cv.generate_custom_voice(t, **KW)[0][0] for t in texts[:3]}
    results, errors = {}, []

    def worker(t):
        try:
            results[t] = cv.generate_custom_voice(t, **dict(KW, seed=1))[0][0]
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(t,)) for t in texts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors and len(results) == len(texts)
    for t in texts[:3]:
        np.testing.assert_array_equal(results[t], alone[t])


def wait_idle(tts) -> None:
    """Until aborts are applied by the engine thread (and delivered)."""
    deadline = time.monotonic() + 10
    while tts.engine.engine.has_unfinished() or not tts.engine._commands.empty():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)
    time.sleep(0.1)


def test_decoder_slots_are_freed_on_every_exit_and_a_full_pool_fails_fast(cv):
    from nano_qwen3tts_vllm.models.codec_decoder import StreamsBusyError
    pool = cv.codecs.slots
    assert pool.in_use() == 0
    gen = cv.generate_custom_voice_streaming("Slot held.", chunk_size=2, first_chunk_size=1, **KW)
    assert pool.in_use() == 0  # nothing is taken before the stream starts
    next(gen)
    assert pool.in_use() == 1

    def consume_then_fail():
        for _ in cv.generate_custom_voice_streaming("Failing consumer.", chunk_size=2, **KW):
            assert pool.in_use() == 2
            raise KeyError("consumer failed")
    with pytest.raises(KeyError):
        consume_then_fail()
    assert pool.in_use() == 1
    del gen  # an abandoned generator is closed when collected
    assert pool.in_use() == 0

    async def async_consumer_fails():
        with pytest.raises(KeyError):
            async with contextlib.aclosing(cv.agenerate_custom_voice_streaming("Async slot.", chunk_size=2,
                                                                               **KW)) as chunks:
                async for _ in chunks:
                    assert pool.in_use() == 1
                    raise KeyError("consumer failed")
        assert pool.in_use() == 0
        await asyncio.to_thread(wait_idle, cv)  # the abort reaches this loop: keep it open till then
    asyncio.run(async_consumer_fails())

    held = [pool.acquire() for _ in range(pool.n)]
    try:
        with pytest.raises(StreamsBusyError, match="streaming decoder slots are in use"):
            next(cv.generate_custom_voice_streaming("No slot left.", **KW))
        assert not cv.engine.engine.has_unfinished() and cv.engine._commands.empty()  # nothing was queued
    finally:
        for slot in held:
            pool.release(slot)
    full, _ = cv.generate_custom_voice("Slots again.", **KW)  # reused slots start clean
    assert_same_audio(full[0], np.concatenate(list(cv.generate_custom_voice_streaming("Slots again.", **KW))))
