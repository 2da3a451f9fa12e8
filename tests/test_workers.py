"""The multiprocess engine (talker and predictor worker processes over ZMQ): same outputs as in-process,
failed requests and a restart when a worker dies, and no orphan process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from conftest import GREEDY
from nano_qwen3tts_vllm.engine.engine_thread import EngineError

KW = dict(speaker="vivian", language="english", max_new_tokens=20, **GREEDY)
TEXTS = ["One two three.", "Four five six seven.", "Eight."]


@pytest.fixture(scope="module")
def mp_tts(ckpt):
    from nano_qwen3tts_vllm import Qwen3TTSInterface
    tts = Qwen3TTSInterface.from_pretrained(ckpt("tiny-random"), device="cpu", dtype=torch.float32, max_num_seqs=8,
                                            max_model_len=512, multiprocess=True)
    yield tts
    tts.close()


def pids(tts) -> list[int]:
    return [p.pid for p in tts.engine.engine.executor.procs.values()] + [tts.codec_worker.proc.pid]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def test_same_outputs_as_in_process(ckpt, ours, mp_tts):
    local = ours(ckpt("tiny-random"))
    for kw in (KW, dict(KW, do_sample=True, subtalker_dosample=True, seed=42)):
        a, _ = local.generate_custom_voice(TEXTS, **kw)
        b, _ = mp_tts.generate_custom_voice(TEXTS, **kw)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_killed_worker_fails_requests_then_workers_restart(mp_tts):
    for role in ("talker", "predictor"):
        stream = mp_tts.generate_custom_voice_streaming("A long one.", speaker="eric", max_new_tokens=400, seed=0,
                                                         chunk_size=1, first_chunk_size=1)  # seeded: no early EOS
        next(stream)
        os.kill(mp_tts.engine.engine.executor.procs[role].pid, signal.SIGKILL)
        with pytest.raises(EngineError, match=f"{role} worker died"):
            for _ in stream:
                pass
        # the engine restarted its workers: it serves again and is healthy
        wavs, _ = mp_tts.generate_custom_voice("After the restart.", **KW)
        assert wavs[0].shape == (19 * 1920,)
        assert mp_tts.stats()["alive"] == 1.0
        bm = mp_tts.engine.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def test_close_leaves_no_worker_behind(ckpt):
    from nano_qwen3tts_vllm import Qwen3TTSInterface
    tts = Qwen3TTSInterface.from_pretrained(ckpt("tiny-random"), device="cpu", dtype=torch.float32, max_num_seqs=2,
                                            max_model_len=128, multiprocess=True)
    workers = pids(tts)
    tts.close()
    assert not any(alive(p) for p in workers)


def worker_children() -> set[int]:
    """This process's live talker and predictor worker processes."""
    out = set()
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == os.getpid() and b"nano_qwen3tts_vllm.workers.worker" in cmd and alive(int(d)):
            out.add(int(d))
    return out


def test_workers_load_together_and_the_talker_sizes_its_kv_cache_last(ckpt):
    """Both workers load at once; the talker takes the memory left for its KV cache only after before_kv (the
    codec worker loading on the same GPU) returns. A failing before_kv leaves no worker behind."""
    from nano_qwen3tts_vllm.config import EngineConfig
    from nano_qwen3tts_vllm.workers.executor import MultiprocessExecutor
    args = (ckpt("tiny-random"), EngineConfig(max_num_seqs=2, max_model_len=128), torch.device("cpu"),
            torch.device("cpu"), torch.float32)
    before = worker_children()
    seen = []
    ex = MultiprocessExecutor(*args, before_kv=lambda: seen.append(len(worker_children() - before)))
    try:
        assert seen == [2] and ex.num_blocks > 0
    finally:
        ex.shutdown()

    def codec_failed():
        raise RuntimeError("the codec worker did not start")
    with pytest.raises(RuntimeError, match="the codec worker did not start"):
        MultiprocessExecutor(*args, before_kv=codec_failed)
    deadline = time.monotonic() + 20
    while worker_children() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_children() - before == set()


def test_workers_exit_when_the_parent_is_killed(ckpt, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time, torch
        from nano_qwen3tts_vllm import Qwen3TTSInterface
        tts = Qwen3TTSInterface.from_pretrained({ckpt("tiny-random")!r}, device="cpu", dtype=torch.float32,
                                                max_num_seqs=2, max_model_len=128, multiprocess=True)
        print("PIDS", *(p.pid for p in tts.engine.engine.executor.procs.values()), flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, PYTHONPATH=os.getcwd()), text=True)
    try:
        line = ""
        while not line.startswith("PIDS"):  # qwen-tts prints a banner on import
            line = parent.stdout.readline()
            assert line, "the parent exited before starting its workers"
        workers = [int(p) for p in line.split()[1:]]
        assert len(workers) == 2 and all(alive(p) for p in workers)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in workers)
    finally:
        parent.kill()


def test_codec_worker_streams_match_local_decoding(ckpt, ours, mp_tts):
    """Streams decoded by the batched codec worker process equal in-process decoding, many at once."""
    import asyncio
    assert mp_tts.codec_worker is not None and mp_tts.codec_worker.is_alive()
    local = ours(ckpt("tiny-random"))
    texts = [f"Stream number {i} decodes in the worker." for i in range(6)]
    kw = dict(speaker="serena", language="english", max_new_tokens=25, chunk_size=5, first_chunk_size=2, **GREEDY)
    expected = [np.concatenate(list(local.generate_custom_voice_streaming(t, **kw))) for t in texts]

    async def one(t):
        return np.concatenate([c async for c in mp_tts.agenerate_custom_voice_streaming(t, **kw)])

    async def all_at_once():
        return await asyncio.gather(*(one(t) for t in texts))
    got = asyncio.run(all_at_once())
    for a, b in zip(expected, got):
        assert a.shape == b.shape
        # the same exact math; batched float32 convolutions only round differently (~5e-5 on this codec)
        assert np.abs(a - b).max() < 2e-4, np.abs(a - b).max()
    assert mp_tts.codec_worker.slots.in_use() == 0


def one_shot(tts, codes: torch.Tensor) -> np.ndarray:
    with torch.inference_mode():
        return tts.speech_tokenizer.model.decoder(codes.T[None])[0, 0].numpy()


def test_codec_worker_client_streams(ckpt, ours, mp_tts):
    """Through the client: chunks sent without waiting run in order, context codes are decoded and dropped,
    streams close (also with chunks still waiting), slots are reused clean, and a full pool fails at once."""
    from nano_qwen3tts_vllm.models.codec_decoder import StreamsBusyError
    client, local = mp_tts.codec_worker, ours(ckpt("tiny-random"))
    gen = torch.Generator().manual_seed(0)
    context, codes = torch.randint(0, 2048, (30, 16), generator=gen), torch.randint(0, 2048, (100, 16), generator=gen)
    bounds = [0, 1, 5, 17, 29, 41, 53, 65, 77, 89, 100]
    streams = [client.open(), client.open(context)]
    for s in streams:
        s.start()
    futs = [[client.submit(s.sid, codes[a:b].tolist()) for a, b in zip(bounds, bounds[1:])] for s in streams]
    plain = np.concatenate([f.result(timeout=60) for f in futs[0]])
    after_context = np.concatenate([f.result(timeout=60) for f in futs[1]])
    assert np.abs(plain - one_shot(local, codes)).max() < 2e-4
    assert np.abs(after_context - one_shot(local, torch.cat([context, codes]))[30 * 1920:]).max() < 2e-4
    # closing with chunks in flight: their futures are cancelled, the slot is free, reuse starts clean
    waiting = [client.submit(streams[0].sid, codes[:12].tolist()) for _ in range(5)]
    for s in streams:
        s.close()
    assert all(f.cancelled() or f.done() for f in waiting)
    assert client.slots.in_use() == 0
    held = [client.slots.acquire() for _ in range(client.slots.n - 1)]
    try:
        last = client.open()  # the one free slot: the one stream 0 or 1 used
        last.start()
        with pytest.raises(StreamsBusyError):
            client.open()
        assert np.abs(last.decode(codes[:12].tolist()) - one_shot(local, codes[:12])).max() < 2e-4
        last.close()
    finally:
        for slot in held:
            client.slots.release(slot)


def test_dead_codec_worker_fails_pending_chunks(ckpt):
    from nano_qwen3tts_vllm.workers.codec_worker import CodecWorkerClient
    client = CodecWorkerClient(ckpt("tiny-random"), "cpu", torch.float32, max_streams=2)
    client.wait_ready()
    try:
        s = client.open()
        s.start()
        frames = torch.randint(0, 2048, (300, 16)).tolist()
        futs = [client.submit(s.sid, frames) for _ in range(20)]  # seconds of work
        os.kill(client.proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="codec worker (died|is not running)"):
            for f in futs:
                f.result(timeout=30)
        assert not client.is_alive()
        with pytest.raises(RuntimeError, match="the codec worker is not running"):
            client.open()
        s.close()  # does not hang on the dead worker, and frees the slot
        assert client.slots.in_use() == 0
    finally:
        client.close()
