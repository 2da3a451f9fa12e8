"""StreamingCodecDecoder: streams decoded a few frames at a time, many per call, equal the reference's
one-shot decode of each whole stream (qwen-tts `Qwen3TTSTokenizerV2Decoder.forward`).

In float64 rounding is out of the way, so equal means the same math: differences are ~1e-13. In float32
this tiny random codec is sensitive (its conv stack grows the signal to std ~85 before the last layer):
the reference itself differs from itself by ~4e-5 between a one-shot decode and the same decode of a
prefix; so float32 tolerances are 2e-4, while a state bug shows as 1e-2 or more.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nano_qwen3tts_vllm.models.codec_decoder import SlotPool, StreamingCodecDecoder, StreamsBusyError

UP = 1920
ATOL = {torch.float64: 1e-9, torch.float32: 2e-4}


@pytest.fixture(scope="module")
def reference(ckpt):
    from qwen_tts import Qwen3TTSTokenizer
    st = Qwen3TTSTokenizer.from_pretrained(ckpt("tiny-random") + "/speech_tokenizer", dtype=torch.float32,
                                           device_map="cpu")
    return st.model.decoder


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["fp64", "fp32"])
def ref(request, reference):
    import copy
    return copy.deepcopy(reference).to(request.param)


def one_shot(ref, codes: torch.Tensor) -> torch.Tensor:
    """codes [T, 16] -> audio [T * 1920], the whole stream in one reference call."""
    with torch.inference_mode():
        return ref(codes.T[None])[0, 0]


def random_codes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (n, 16), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_long_stream_in_uneven_chunks_equals_one_shot(ref):
    """300 frames, far past the 72-frame attention window, in chunks of 1, 4, 12, ..., 7 frames."""
    codes = random_codes(300, 0)
    full = one_shot(ref, codes)
    dec = StreamingCodecDecoder(ref, max_streams=4)
    slot = torch.tensor([2])
    sizes = [1, 4] + [12] * 24 + [7]
    assert sum(sizes) == 300
    out, start = [], 0
    for n in sizes:
        wav = dec.decode(slot, codes[start:start + n][None])
        assert wav.shape == (1, n * UP) and wav.dtype == ref.dtype
        out.append(wav[0])
        start += n
    diff = max_diff(torch.cat(out), full)
    assert diff < ATOL[ref.dtype], diff
    # the state is what makes it exact: the same last chunk decoded without its history is far off
    dec.reset(slot)
    assert max_diff(dec.decode(slot, codes[-7:][None])[0], full[-7 * UP:]) > 1e-2


def test_streams_of_different_lengths_and_start_times_share_one_decoder(ref):
    """Four streams start at different steps; each step feeds T frames to every stream with T left, all
    in one batched call (any slot order), the rest alone; each stream equals its own one-shot decode."""
    lengths, starts, slots = [150, 90, 41, 200], [0, 2, 3, 5], [5, 0, 3, 7]
    codes = [random_codes(n, 10 + i) for i, n in enumerate(lengths)]
    dec = StreamingCodecDecoder(ref, max_streams=8)
    fed, out = [0] * 4, [[] for _ in range(4)]
    step, batched = 0, 0
    while any(f < n for f, n in zip(fed, lengths)):
        t = (3, 12, 5)[step % 3]
        live = [i for i in range(4) if step >= starts[i] and fed[i] < lengths[i]]
        full = [i for i in live if lengths[i] - fed[i] >= t][::-1]
        if full:
            batch = torch.stack([codes[i][fed[i]:fed[i] + t] for i in full])
            wav = dec.decode(torch.tensor([slots[i] for i in full]), batch)
            batched += len(full) > 1
            for i, w in zip(full, wav):
                out[i].append(w)
                fed[i] += t
        for i in set(live) - set(full):  # a short tail: alone
            wav = dec.decode(torch.tensor([slots[i]]), codes[i][fed[i]:][None])
            out[i].append(wav[0])
            fed[i] = lengths[i]
        step += 1
    assert batched > 10
    for i in range(4):
        diff = max_diff(torch.cat(out[i]), one_shot(ref, codes[i]))
        assert diff < ATOL[ref.dtype], (i, diff)


def test_reset_makes_a_reused_slot_start_clean(ref):
    a, b, c = random_codes(100, 20), random_codes(60, 21), random_codes(80, 22)
    dec = StreamingCodecDecoder(ref, max_streams=3)
    s1, s2 = torch.tensor([1]), torch.tensor([2])
    dec.decode(s1, a[None])
    c_head = dec.decode(s2, c[:30][None])[0]
    dated = dec.decode(s1, b[None])[0]          # slot 1 still carries stream a
    assert max_diff(dated, one_shot(ref, b)) > 1e-2
    dec.reset(s1)
    dec.decode(s1, a[:50][None])
    dec.reset(s1)
    fresh = torch.cat([dec.decode(s1, b[:7][None])[0], dec.decode(s1, b[7:][None])[0]])
    assert max_diff(fresh, one_shot(ref, b)) < ATOL[ref.dtype]
    # resetting slot 1 left slot 2 alone
    c_tail = dec.decode(s2, c[30:][None])[0]
    assert max_diff(torch.cat([c_head, c_tail]), one_shot(ref, c)) < ATOL[ref.dtype]


def test_context_frames_then_stream_equals_the_tail_of_one_shot(ref):
    """ICL: the reference codes are decoded first and their audio dropped; the stream then continues them."""
    context, gen = random_codes(90, 30), random_codes(50, 31)
    dec = StreamingCodecDecoder(ref, max_streams=1)
    slot = torch.tensor([0])
    dec.decode(slot, context[None])
    out = torch.cat([dec.decode(slot, gen[i:i + 12][None])[0] for i in range(0, 50, 12)])
    full = one_shot(ref, torch.cat([context, gen]))
    assert max_diff(out, full[90 * UP:]) < ATOL[ref.dtype]


def test_whole_clips_equal_the_references_chunked_decode(ref):
    """decode_clips, batched and fed a few frames per call, equals qwen-tts's chunked_decode of each clip alone:
    300-frame chunks from a fresh state after 25 frames of context (so past 300 frames it is not the one-shot
    decode), cut to the clip's length; an empty clip gives empty audio."""
    lengths = [620, 125, 301, 7, 0]
    clips = [random_codes(n, 40 + i) for i, n in enumerate(lengths)]
    dec = StreamingCodecDecoder(ref, max_streams=1)
    out = dec.decode_clips(clips, batch=3, piece=40)
    for clip, wav in zip(clips, out):
        assert wav.shape == (len(clip) * UP,)
        if len(clip):
            with torch.inference_mode():
                expected = ref.chunked_decode(clip.T[None])[0, 0]
            assert max_diff(wav, expected) < ATOL[ref.dtype]
    # the chunking is what the reference does: a continuous decode of the long clip differs after frame 300
    assert max_diff(out[0][300 * UP:], one_shot(ref, clips[0])[300 * UP:]) > 1e-2


def test_clips_decoded_while_generated_equal_the_references_chunked_decode(ref):
    """decode_while_generating reads frames as they come (iterators standing in for the engine's streams), in
    batches of 2 clips that end at different frames, one with a prefix (ICL reference codes): each clip's audio is
    the reference's chunked_decode of prefix + frames, and the codes are returned whole."""
    from nano_qwen3tts_vllm.api.clip_pipeline import decode_while_generating
    lengths = [330, 301, 7, 0, 30]  # the last, with its prefix of 20, ends on a piece boundary (25 frames)
    clips = [random_codes(n, 60 + i) for i, n in enumerate(lengths)]
    prefixes = [None, None, None, None, random_codes(20, 70)]
    read = []

    def frames(i):
        for t, f in enumerate(clips[i].tolist()):
            read.append((i, t))
            yield f
    dec = StreamingCodecDecoder(ref, max_streams=1)
    codes, audio = decode_while_generating(dec, [frames(i) for i in range(5)], prefixes, group=2)
    assert read[:2] == [(0, 0), (0, 1)] and len(read) == sum(lengths)
    # read (and decoded) a piece at a time, every batch in turn: not clip by clip, nor batch by batch
    assert read.index((1, 30)) < read.index((0, 300)) and read.index((2, 0)) < read.index((0, 30))
    for clip, prefix, c, wav in zip(clips, prefixes, codes, audio):
        whole = clip if prefix is None else torch.cat([prefix, clip])
        assert torch.equal(c, whole) and wav.shape == (len(whole) * UP,)
        if len(whole):
            with torch.inference_mode():
                expected = ref.chunked_decode(whole.T[None])[0, 0]
            assert max_diff(wav, expected) < ATOL[ref.dtype]


def test_triton_convolutions_equal_the_reference(reference):
    """The fused Triton convolutions (snake before, residual after, carried inputs read in place; on CPU in
    Triton's interpreter) give the one-shot decode, streamed in uneven chunks by two streams at once."""
    pytest.importorskip("triton", reason="the fused convolution kernel needs triton")
    import copy
    device = "cuda" if torch.cuda.is_available() else "cpu"
    codes = [random_codes(12, 50), random_codes(12, 51)]
    dec = StreamingCodecDecoder(copy.deepcopy(reference).to(device), max_streams=2, triton=True)
    assert any(w.dim() == 3 for w in dec.weights.values())  # the kernel's [taps, in, out] operands are in use
    slots, out, start = torch.tensor([1, 0], device=device), [], 0
    for n in (1, 3, 8):
        out.append(dec.decode(slots, torch.stack([c[start:start + n] for c in codes]).to(device)))
        start += n
    wav = torch.cat(out, 1).cpu()
    for i, c in enumerate(codes):
        diff = max_diff(wav[i], one_shot(reference, c))
        assert diff < ATOL[torch.float32], (i, diff)


def test_slot_pool_never_waits():
    pool = SlotPool(2)
    a, b = pool.acquire(), pool.acquire()
    assert {a, b} == {0, 1} and pool.in_use() == 2
    with pytest.raises(StreamsBusyError, match="all 2 streaming decoder slots are in use"):
        pool.acquire()
    pool.release(a)
    assert pool.acquire() == a


# ---- the codec worker's scheduling, in process ---------------------------------------------------

class FakeSocket:
    """Collects what the worker would send back."""

    def __init__(self):
        self.sent = []

    def send_multipart(self, frames, copy=False):
        import pickle
        header = pickle.loads(frames[0])
        header.pop("_tensors")
        tensors = [np.frombuffer(bytes(f), dtype=np.float32) for f in frames[1:]]
        self.sent.append((header, tensors))


def test_codec_worker_batches_equal_lengths_and_keeps_each_stream_in_order(reference):
    from nano_qwen3tts_vllm.workers.codec_worker import CodecWorker
    dec = StreamingCodecDecoder(reference, max_streams=4)
    calls = []
    decode = dec.decode
    dec.decode = lambda slots, codes: calls.append((slots.tolist(), codes.shape[1])) or decode(slots, codes)
    out = FakeSocket()
    worker = CodecWorker(dec, out, max_batch=2)
    bounds = [[0, 4, 16, 20], [0, 4, 12], [0, 5, 10], [0, 4]]  # chunk boundaries per stream, all queued at once
    codes = [random_codes(b[-1], 40 + i) for i, b in enumerate(bounds)]
    jobs = {}
    for sid, b in enumerate(bounds):
        worker.handle({"op": "open", "stream": sid, "slot": 3 - sid}, [])
        for start, end in zip(b, b[1:]):
            jobs[len(jobs)] = sid
            worker.handle({"op": "decode", "id": len(jobs) - 1, "stream": sid}, [codes[sid][start:end].to(torch.int16)])
    rounds = 0
    while worker.has_work():
        worker.run_round()
        rounds += 1
    # one chunk per stream per round, equal lengths batched (at most max_batch=2 per call), shortest first
    assert calls == [([3, 2], 4), ([0], 4), ([1], 5), ([1], 5), ([2], 8), ([3], 12), ([3], 4)]
    assert rounds == 3
    got = {h["id"]: torch.from_numpy(t[0].copy()) for h, t in out.sent}
    assert set(got) == set(jobs)
    for sid in range(4):
        audio = torch.cat([got[j] for j in sorted(jobs) if jobs[j] == sid])  # job ids were given in order
        assert max_diff(audio, one_shot(reference, codes[sid])) < ATOL[torch.float32]
    # closing drops waiting chunks; a chunk for a closed stream is answered with an error
    worker.handle({"op": "decode", "id": 100, "stream": 0}, [codes[0][:3].to(torch.int16)])
    worker.handle({"op": "close", "stream": 0}, [])
    assert not worker.has_work()
    worker.handle({"op": "decode", "id": 101, "stream": 0}, [codes[0][:3].to(torch.int16)])
    assert out.sent[-1][0] == {"op": "error", "id": 101, "error": "stream 0 is not open in the codec worker"}
