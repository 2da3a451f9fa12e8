"""The fused decode attention kernel (q/k norm + RoPE + cache write + paged attention) against the
unfused PyTorch ops. On CPU the kernel runs in the Triton interpreter (conftest sets TRITON_INTERPRET)."""
from __future__ import annotations

import pytest
import torch

from nano_qwen3tts_vllm.layers.attention import PagedMetadata, store_kv, torch_decode
from nano_qwen3tts_vllm.layers.fused import rms_norm, rope

triton = pytest.importorskip("triton", reason="the fused kernels need triton")

SMALL = (4, 2, 32, 8)  # q heads, kv heads, head_dim, block size (the interpreter is slow)


def unfused(qkv, qw, kw, cos, sin, pos, k_cache, v_cache, tables):
    B, HQ, (_, _, HKV, D) = qkv.shape[0], qkv.shape[1] // k_cache.shape[-1] - 2 * k_cache.shape[2], k_cache.shape
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q = rms_norm(q.view(B, HQ, D), qw, 1e-6)
    k = rms_norm(k.view(B, HKV, D), kw, 1e-6)
    q, k = rope(q, k, cos[pos], sin[pos])
    bs = k_cache.shape[1]
    slots = tables.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs
    store_kv(k, v.view(B, HKV, D), k_cache, v_cache, slots)
    meta = PagedMetadata(is_prefill=False, slot_mapping=slots, context_lens=(pos + 1).int(), block_tables=tables)
    return torch_decode(q, k_cache, v_cache, meta, D ** -0.5).reshape(B, HQ * D)


def setup(device, dtype, positions, dims=SMALL, seed=0):
    HQ, HKV, D, BS = dims
    g = torch.Generator().manual_seed(seed)
    B = len(positions)
    width = max(positions) // BS + 1
    blocks = torch.randperm(B * width + 3, generator=g)[:B * width].view(B, width).int()
    cache = torch.randn(2, B * width + 4, BS, HKV, D, generator=g)
    t = dict(qkv=torch.randn(B, (HQ + 2 * HKV) * D, generator=g), qw=torch.rand(D, generator=g) + 0.5,
             kw=torch.rand(D, generator=g) + 0.5, cos=torch.randn(max(positions) + 1, D, generator=g),
             sin=torch.randn(max(positions) + 1, D, generator=g), pos=torch.tensor(positions), k_cache=cache[0], v_cache=cache[1],
             tables=blocks)
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in t.items()}


def fused(t, splits=1):
    from nano_qwen3tts_vllm.layers.triton_attention import fused_decode
    D, HKV = t["k_cache"].shape[-1], t["k_cache"].shape[-2]
    HQ = t["qkv"].shape[1] // D - 2 * HKV
    return fused_decode(t["qkv"], t["qw"], t["kw"], 1e-6, t["cos"], t["sin"], t["pos"], t["k_cache"], t["v_cache"],
                        t["tables"], HQ, D ** -0.5, splits=splits)


def devices():
    """CPU (interpreted) where there is no GPU; compiled fp32 and bf16 where there is."""
    if torch.cuda.is_available():
        return [("cuda", torch.float32), ("cuda", torch.bfloat16)]
    return [("cpu", torch.float32)]


def check_against_unfused(device, dtype, positions, dims, splits=1):
    a, b = setup(device, dtype, positions, dims), setup(device, dtype, positions, dims)
    out = fused(a, splits)
    ref = unfused(b["qkv"], b["qw"], b["kw"], b["cos"], b["sin"], b["pos"], b["k_cache"], b["v_cache"], b["tables"])
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a["k_cache"], b["k_cache"], atol=1e-5, rtol=1e-5)
    else:  # bf16: the two paths accumulate in different orders, so single elements differ by an ulp or so
        for x, y in ((out, ref), (a["k_cache"], b["k_cache"])):
            rel = ((x.float() - y.float()).norm() / y.float().norm()).item()
            assert rel < 1e-2, rel
    # the new v landed in the same cache slots, and nothing else changed
    torch.testing.assert_close(a["v_cache"], b["v_cache"], atol=0, rtol=0)


@pytest.mark.parametrize("device,dtype", devices())
@pytest.mark.parametrize("splits", [1, 4])  # 4: at 37 positions, splits of 16, 16, 5 and an empty one
def test_fused_decode_matches_unfused_ops(device, dtype, splits):
    check_against_unfused(device, dtype, [0, 5, 8, 37], SMALL, splits)  # first, inside a block, a boundary, several


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real model sizes: compiled kernel on a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 17, 256])  # 17: the predictor's dense cache, one block per row
@pytest.mark.parametrize("splits", [1, 16])
def test_fused_decode_real_sizes(dtype, block_size, splits):
    check_against_unfused("cuda", dtype, [0, 1, 15, 16, block_size, 3 * block_size - 2, 200, 700],
                          (16, 8, 128, block_size), splits)


@pytest.mark.parametrize("device,dtype", devices())
@pytest.mark.parametrize("splits", [1, 4])
def test_fused_decode_is_batch_invariant_and_takes_one_shared_position(device, dtype, splits):
    t = setup(device, dtype, [9, 9, 9])
    batch = fused(t, splits)
    one = setup(device, dtype, [9, 9, 9])
    shared = dict(one, pos=torch.tensor([9], device=device).expand(3))  # stride 0, as the predictor passes it
    assert torch.equal(fused(shared, splits), batch)
    alone = setup(device, dtype, [9, 9, 9])
    alone = {k: (v[1:2] if k in ("qkv", "pos", "tables") else v) for k, v in alone.items()}
    assert torch.equal(fused(alone, splits)[0], batch[1])


def force_fused(engine) -> int:
    """Switch a CPU engine onto the Triton kernels (interpreted): talker prefill and decode, predictor decode."""
    from nano_qwen3tts_vllm.layers.attention import DenseAttention, PagedAttention
    n = 0
    for runner in (engine.executor.talker, engine.executor.predictor):
        for m in runner.model.modules():
            if isinstance(m, PagedAttention):
                m.backend, n = "triton", n + 1
            elif isinstance(m, DenseAttention):
                m.rows, n = torch.arange(engine.cfg.max_num_seqs + 1, dtype=torch.int32)[:, None], n + 1
    return n


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check; on a GPU the engine uses the compiled "
                    "kernels by default and test_gpu.py checks it")
def test_engine_frames_unchanged_with_triton_kernels(ckpt, ours):
    """Greedy fp32: Triton prefill and the fused talker and predictor steps give the torch path's frames."""
    from test_batching import TEXTS, new_engine, run
    from conftest import GREEDY
    model_dir = ckpt("tiny-random")
    tts = ours(model_dir)
    requests = []
    for i, (text, spk) in enumerate(zip(TEXTS[:3], ["vivian", "eric", "ryan"])):
        jobs = tts._custom_voice_jobs(text, spk, "english", None, i % 2 == 0, dict(max_new_tokens=8, **GREEDY))
        requests += [(j.prompt, j.params) for j in jobs]
    schedule = {0: [0], 2: [1, 2]}  # rows join mid-way: positions differ across the batch
    expected = run(new_engine(model_dir), requests, schedule)
    engine = new_engine(model_dir)
    assert force_fused(engine) == 4
    assert run(engine, requests, schedule) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check; test_gpu.py runs the captured graphs")
def test_padded_prefill_inputs_match_the_packed_prefill(ckpt, ours):
    """What a prefill CUDA graph computes (inputs padded to a token bucket and to max_num_seqs sequences, run
    here without capture) equals the packed prefill, for every real sequence."""
    from test_batching import TEXTS, new_engine
    from conftest import GREEDY
    model_dir = ckpt("tiny-random")
    tts = ours(model_dir)
    engine = new_engine(model_dir)
    force_fused(engine)
    for text in TEXTS[:3]:
        job = tts._custom_voice_jobs(text, "vivian", "english", None, True, dict(max_new_tokens=4, **GREEDY))[0]
        engine.add_request(job.prompt, job.params)
    seqs, is_prefill = engine.scheduler.schedule()
    assert is_prefill and len(seqs) == 3
    rows = [s.prefill_row() for s in seqs]
    talker = engine.executor.talker
    hidden, logits = talker.prefill(rows)
    lens = [r.num_tokens - r.num_cached_tokens for r in rows]
    bucket = 2 * sum(lens)
    arrays = talker._prefill_arrays(rows, lens, bucket, engine.cfg.max_num_seqs, talker.max_blocks_per_seq)
    padded = talker._padded_prefill_body({k: torch.from_numpy(v) for k, v in arrays.items()}, bucket)
    torch.testing.assert_close(padded[0][:3], hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded[1][:3], logits, atol=1e-5, rtol=1e-5)
