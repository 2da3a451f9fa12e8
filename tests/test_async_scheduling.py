"""Async scheduling (decode step t+1 launched before step t is read) changes no output: the same frames and
finish reasons as the synchronous engine, with sequences stopping, finishing, aborted and preempted while the
next step is already in flight."""
from __future__ import annotations

import dataclasses
import shutil
from collections import defaultdict

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import GREEDY
from test_batching import SPEAKERS, TEXTS, new_engine, sampled

INSTRUCT = "Speak like a calm narrator reading a long bedtime story to a sleepy child, slowly."


@pytest.fixture(scope="module")
def model_dir(ckpt):
    return ckpt("tiny-random")


@pytest.fixture(scope="module")
def eos_dir(model_dir, tmp_path_factory):
    """tiny-random with an EOS row along a fixed random direction of the talker's hidden state: requests stop
    after different numbers of frames, greedy or sampled, and some run to max_new_tokens."""
    dst = tmp_path_factory.mktemp("eos") / "tiny-random-early-eos"
    shutil.copytree(model_dir, dst)
    weights = load_file(dst / "model.safetensors")
    head = weights["talker.codec_head.weight"]
    u = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(0))
    head[2150] = 20.0 * u / u.norm()  # 2150: codec_eos_token_id of the tiny checkpoints
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def jobs(model_dir, ours):
    """6 prompts as in test_batching (3 non-streaming, 3 streaming-text) and 2 sharing a long instruct (prefix
    cache); greedy, 18 frames at most."""
    tts = ours(model_dir)
    kw = dict(max_new_tokens=18, **GREEDY)
    out = []
    for i, (text, spk) in enumerate(zip(TEXTS, SPEAKERS)):
        out += tts._custom_voice_jobs(text, spk, "english", None, i % 2 == 0, kw)
    for text in ("First.", "Second one."):
        out += tts._custom_voice_jobs(text, "serena", "english", INSTRUCT, True, kw)
    return [(j.prompt, j.params) for j in out]


@dataclasses.dataclass
class Run:
    results: list[tuple[list[list[int]], str]]  # per request: frames, finish reason
    overlapped: int = 0     # steps that returned with the next decode step in flight
    discarded: int = 0      # sequences that stopped (EOS) while their next step was in flight
    aborted_in_flight: int = 0
    preemptions: int = 0


def drive(engine, requests, add_at: dict[int, list[int]] | None = None,
          abort_at: dict[int, int] | None = None) -> Run:
    """Run requests [(prompt, params)] to completion. add_at: step number -> requests added before it (all at
    step 0 if None); abort_at: request -> abort it once it has that many frames. Checks that step() delivered
    every frame and one finish per request, that frames start from their sampled c0, and that every block
    and slot is free at the end."""
    add_at, abort_at = add_at or {0: list(range(len(requests)))}, abort_at or {}
    seqs, delivered, finishes = {}, defaultdict(list), defaultdict(list)
    run = Run([])
    step = 0
    while step <= max(add_at) or engine.has_unfinished():
        for i in add_at.get(step, []):
            seqs[i] = engine.add_request(*requests[i], request_id=str(i))
        for out in engine.step():
            i = int(out.request_id)
            if out.frame is not None:
                delivered[i].append(out.frame)
            if out.finished:
                finishes[i].append(out.finish_reason)
                run.discarded += out.finish_reason == "stop" and seqs[i].inflight > 0
        if engine._inflight is not None:
            run.overlapped += 1  # and no sequence was launched past its max_new_tokens
            assert all(len(s.c0) + s.inflight <= s.params.max_new_tokens for s in engine._inflight.seqs)
        for i, n in abort_at.items():
            if i in seqs and not seqs[i].is_finished and len(seqs[i].frames) >= n:
                run.aborted_in_flight += seqs[i].inflight > 0
                assert engine.abort(str(i))
        step += 1
    for i, seq in seqs.items():
        assert delivered[i] == seq.frames
        assert finishes[i] == ([] if seq.finish_reason == "abort" else [seq.finish_reason])
        assert seq.inflight == 0
        assert [f[0] for f in seq.frames] == seq.c0[:len(seq.frames)]  # each frame starts from its sampled c0
    run.results = [(seqs[i].frames, seqs[i].finish_reason) for i in range(len(requests))]
    run.preemptions = engine.scheduler.num_preemptions
    s = engine.scheduler
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks and not s.block_manager.used_block_ids
    assert sorted(s.free_slots) == list(range(engine.cfg.max_num_seqs)) and not engine.seqs
    return run


def on_and_off(model_dir, requests, add_at=None, abort_at=None, **cfg) -> tuple[Run, Run]:
    """(async run, synchronous run), checked to give the same frames and finish reasons."""
    on, off = (drive(new_engine(model_dir, async_scheduling=flag, **cfg), requests, add_at, abort_at)
               for flag in (True, False))
    assert on.results == off.results
    assert on.overlapped > 0 and off.overlapped == 0
    return on, off


def test_staggered_greedy_with_length_limits(model_dir, jobs):
    """max_new_tokens 1 (done at the prefill), 2 (done with the first decode step, so never launched twice)
    and others, requests joining while steps are in flight."""
    limits = [18, 2, 9, 1, 18, 5, 3, 12]
    requests = [(p, dataclasses.replace(sp, max_new_tokens=n)) for (p, sp), n in zip(jobs, limits)]
    on, _ = on_and_off(model_dir, requests, add_at={0: [0, 3], 2: [1], 3: [2, 6], 5: [4], 9: [5, 7]})
    assert [len(frames) for frames, _ in on.results] == [n - 1 for n in limits]
    assert {reason for _, reason in on.results} == {"length"}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_eos_at_different_steps(eos_dir, jobs, sampling):
    """Sequences that stop (EOS) were already launched into the next step: those results are dropped."""
    requests = jobs if sampling == "greedy" else [(p, sampled(sp, seed=100 + i)) for i, (p, sp) in enumerate(jobs)]
    on, _ = on_and_off(eos_dir, requests, add_at={0: [0, 1, 2], 1: [3], 4: [4, 6], 6: [5], 12: [7]})
    stops = [len(frames) for frames, reason in on.results if reason == "stop"]
    assert len(set(stops)) >= 3 and any(reason == "length" for _, reason in on.results), on.results
    assert on.discarded >= 3


def test_abort_while_a_step_is_in_flight(eos_dir, jobs):
    requests = [(p, sampled(sp, seed=7 + i)) for i, (p, sp) in enumerate(jobs)]
    on, _ = on_and_off(eos_dir, requests, add_at={0: [0, 1, 2, 3], 3: [4, 5, 6], 8: [7]},
                       abort_at={0: 1, 3: 4, 5: 2, 6: 0, 7: 3})
    assert on.aborted_in_flight >= 3
    assert sum(reason == "abort" for _, reason in on.results) >= 4


def test_aborting_everything_in_flight_leaves_a_step_to_collect(model_dir, jobs):
    engine = new_engine(model_dir)
    seqs = [engine.add_request(*r) for r in jobs[:3]]
    engine.step()  # prefill
    assert len(engine.step()) == 3 and engine._inflight is not None
    for seq in seqs:
        assert seq.inflight == 1 and engine.abort(seq.request_id)
    assert engine.has_unfinished()
    assert engine.step() == [] and not engine.has_unfinished()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(s.inflight == 0 for s in seqs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_waiting_request_is_admitted_at_once(model_dir, jobs, async_scheduling):
    """Pipelined, the engine collects the step in flight instead of launching another, then prefills."""
    engine = new_engine(model_dir, async_scheduling=async_scheduling)
    for r in jobs[:2]:
        engine.add_request(*r)
    for _ in range(3):
        engine.step()
    late = engine.add_request(*jobs[2])
    outputs = engine.step()
    if async_scheduling:
        assert len(outputs) == 2 and engine._inflight is None and not late.c0
        engine.step()
    assert len(late.c0) == 1


def test_preemption_under_tiny_kv_budget(model_dir, jobs):
    requests = jobs + [(p, sampled(sp, seed=5 + i)) for i, (p, sp) in enumerate(jobs)]
    longest = max(len(p) + sp.max_new_tokens for p, sp in requests)
    on, off = on_and_off(model_dir, requests, num_kvcache_blocks=(longest + 3) // 4 + 6, max_num_seqs=16)
    assert on.preemptions > 0 and off.preemptions > 0
