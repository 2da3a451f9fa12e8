"""Continuous batching, seeded sampling, preemption and prefix caching change no output."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import GREEDY
from nano_qwen3tts_vllm.config import EngineConfig
from nano_qwen3tts_vllm.engine.llm_engine import LLMEngine

TEXTS = ["One.", "Two words here.", "A third, longer sentence to batch.", "Four is short.",
         "Fifth request joins late.", "And the sixth one too, with a few more words."]
SPEAKERS = ["vivian", "eric", "ryan", "sohee", "dylan", "aiden"]


@pytest.fixture(scope="module")
def model_dir(ckpt):
    return ckpt("tiny-random")


@pytest.fixture(scope="module")
def jobs(model_dir, ours):
    """Validated prompts from the interface: 3 non-streaming, 3 streaming-text."""
    tts = ours(model_dir)
    out = []
    for i, (text, spk) in enumerate(zip(TEXTS, SPEAKERS)):
        out += tts._custom_voice_jobs(text, spk, "english", None, i % 2 == 0, dict(max_new_tokens=18, **GREEDY))
    return out


def new_engine(model_dir, **kw) -> LLMEngine:
    cfg = dict(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=512, kvcache_block_size=4)
    cfg.update(kw)
    return LLMEngine(model_dir, EngineConfig(**cfg), device="cpu", dtype=torch.float32)


def run(engine: LLMEngine, requests, schedule: dict[int, list[int]] | None = None) -> list[list[list[int]]]:
    """Run requests [(prompt, params)]; schedule maps step number -> indices added before that step."""
    schedule = schedule or {0: list(range(len(requests)))}
    seqs = {}
    step = 0
    while step <= max(schedule) or engine.has_unfinished():
        for i in schedule.get(step, []):
            seqs[i] = engine.add_request(*requests[i])
        engine.step()
        step += 1
    return [seqs[i].frames for i in range(len(requests))]


def solo(model_dir, requests) -> list[list[list[int]]]:
    return [run(new_engine(model_dir), [r])[0] for r in requests]


def sampled(params, seed):
    return dataclasses.replace(params, do_sample=True, subtalker_dosample=True, top_k=20, top_p=0.9,
                               temperature=0.8, subtalker_temperature=0.8, seed=seed)


def test_staggered_greedy_equals_solo(model_dir, jobs):
    requests = [(j.prompt, j.params) for j in jobs]
    alone = solo(model_dir, requests)
    assert all(len(f) == 17 for f in alone)
    batched = run(new_engine(model_dir), requests, schedule={0: [0], 3: [1, 2], 5: [3], 11: [4], 12: [5]})
    assert batched == alone


def test_seeded_sampling_same_alone_or_batched(model_dir, jobs):
    requests = [(j.prompt, sampled(j.params, seed=1000 + i)) for i, j in enumerate(jobs)]
    alone = solo(model_dir, requests)
    mixed = run(new_engine(model_dir), requests, schedule={0: [5, 2], 2: [0], 4: [1, 3, 4]})
    assert mixed == alone
    # unseeded neighbours do not disturb a seeded request either
    noisy = [(j.prompt, sampled(j.params, seed=None)) for j in jobs]
    again = run(new_engine(model_dir), [requests[0]] + noisy[1:], schedule={0: [1, 2, 0], 1: [3, 4, 5]})
    assert again[0] == alone[0]
    # and a different seed gives different audio
    other = solo(model_dir, [(requests[0][0], sampled(requests[0][1], seed=7))])[0]
    assert other != alone[0]


def test_preemption_under_tiny_kv_budget(model_dir, jobs):
    requests = [(j.prompt, j.params) for j in jobs] + [(j.prompt, sampled(j.params, seed=5 + i))
                                                         for i, j in enumerate(jobs)]
    alone = solo(model_dir, requests)
    longest = max(len(p) + sp.max_new_tokens for p, sp in requests)
    engine = new_engine(model_dir, num_kvcache_blocks=(longest + 3) // 4 + 6, max_num_seqs=12)
    out = run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    assert out == alone
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.used_block_ids
    assert sorted(engine.scheduler.free_slots) == list(range(12))


def test_abort_frees_blocks(model_dir, jobs):
    engine = new_engine(model_dir)
    seqs = [engine.add_request(j.prompt, j.params) for j in jobs]
    for _ in range(4):
        engine.step()
    assert engine.abort(seqs[1].request_id) and engine.abort(seqs[4].request_id)
    assert not engine.abort("no-such-request")
    while engine.has_unfinished():
        engine.step()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert seqs[1].finish_reason == "abort" and seqs[0].finish_reason == "length"


def test_prefix_cache_reuses_shared_prompt_blocks(model_dir, ours):
    tts = ours(model_dir)
    instruct = "Speak like a calm narrator reading a long bedtime story to a sleepy child, slowly."
    kw = dict(max_new_tokens=10, **GREEDY)
    a, b = (tts._custom_voice_jobs(t, "serena", "english", instruct, True, kw)[0] for t in ("First.", "Second one."))
    engine = new_engine(model_dir)
    run(engine, [(a.prompt, a.params)])
    seq = engine.add_request(b.prompt, b.params)
    assert seq.num_cached_tokens == 0
    engine.step()  # prefill
    assert seq.num_cached_tokens >= 16, "the shared instruct blocks should come from the cache"
    while engine.has_unfinished():
        engine.step()
    cold = run(new_engine(model_dir, enable_prefix_caching=False), [(b.prompt, b.params)])[0]
    assert seq.frames == cold


def test_request_that_cannot_fit_is_refused(model_dir, jobs):
    engine = new_engine(model_dir, max_model_len=32, max_num_batched_tokens=64)
    p = jobs[0].prompt
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request(p, dataclasses.replace(jobs[0].params, max_new_tokens=40))
    assert not engine.has_unfinished()
