"""Programmatic dependent launch (layers/pdl.py): the decode kernels launched early must still read only what the
kernel before them finished writing. A chain shaped like the predictor's codebook steps (lm head, sampler,
embedding gather + projection, add + RMSNorm + qkv, split attention and its merge, o_proj), each kernel reading
the previous one's output, runs in a CUDA graph with PDL and without: the greedy codes and the final state must
be bitwise the same."""
from __future__ import annotations

import pytest
import torch

from nano_qwen3tts_vllm.layers import pdl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="PDL needs a Hopper (sm90) or newer GPU")

H, V, HQ, HKV, D, STEPS = 1024, 2048, 16, 8, 128, 15


def _weights():
    g = torch.Generator().manual_seed(0)
    w = dict(head=torch.randn(V, H, generator=g) * 0.2, table=torch.randn(V, H, generator=g),
             proj=torch.randn(H, H, generator=g) / H ** 0.5, bias=torch.randn(H, generator=g),
             norm=torch.rand(H, generator=g) + 0.5, qkv=torch.randn((HQ + 2 * HKV) * D, H, generator=g) / H ** 0.5,
             qw=torch.rand(D, generator=g) + 0.5, kw=torch.rand(D, generator=g) + 0.5,
             cos=torch.randn(STEPS + 1, D, generator=g), sin=torch.randn(STEPS + 1, D, generator=g),
             o=torch.randn(H, HQ * D, generator=g) / (HQ * D) ** 0.5)
    return {k: v.cuda().bfloat16() for k, v in w.items()}


def _chain(w, h, cache, positions, tables, greedy):
    from nano_qwen3tts_vllm.layers.triton_attention import fused_decode
    from nano_qwen3tts_vllm.layers.triton_linear import embedding_gemv, gemv, norm_gemv
    from nano_qwen3tts_vllm.layers.triton_sampler import triton_sample
    codes, r = [], torch.zeros_like(h)
    for i in range(STEPS):
        ids = triton_sample(gemv(h, w["head"]), *greedy, counters=0)
        codes.append(ids)
        x = embedding_gemv(ids, 0, w["table"], w["proj"], w["bias"])
        qkv, r = norm_gemv(x, r, w["norm"], 1e-6, w["qkv"])
        o = fused_decode(qkv, w["qw"], w["kw"], 1e-6, w["cos"], w["sin"], positions[i:i + 1], cache[0], cache[1],
                         tables, HQ, D ** -0.5, splits=4)
        h = gemv(o, w["o"])
    return torch.stack(codes, 1), h, r


def _run(monkeypatch, enabled: bool, graph: bool):
    monkeypatch.setattr(pdl, "ENABLED", enabled)
    w = _weights()
    h = (torch.randn(1, H, generator=torch.Generator().manual_seed(1)) * 3).cuda().bfloat16()
    cache = torch.zeros(2, 2, STEPS + 1, HKV, D, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(STEPS + 1, device="cuda")
    tables = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    greedy = (torch.zeros(1, dtype=torch.bool, device="cuda"), torch.ones(1, device="cuda"),
              torch.zeros(1, dtype=torch.long, device="cuda"), torch.ones(1, device="cuda"),
              torch.zeros(1, dtype=torch.long, device="cuda"))
    with torch.inference_mode():
        if not graph:
            return _chain(w, h, cache, positions, tables, greedy) + (cache,)
        _chain(w, h, cache.clone(), positions, tables, greedy)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = _chain(w, h, cache, positions, tables, greedy)
        cache.zero_()
        g.replay()
        torch.cuda.synchronize()
        return out + (cache,)


def test_pdl_is_on_for_hopper_tensors():
    assert pdl.use_pdl(torch.zeros(1, device="cuda")) == pdl.ENABLED
    assert not pdl.use_pdl(torch.zeros(1))


def test_pdl_chain_in_a_cuda_graph_equals_serial_launches(monkeypatch):
    eager = _run(monkeypatch, False, graph=False)
    assert len(set(eager[0][0].tolist())) > 3  # the codes move from step to step
    for enabled in (False, True):
        got = _run(monkeypatch, enabled, graph=True)
        for a, b in zip(got, eager):
            assert torch.equal(a, b), f"PDL={enabled}: the graph's result differs from eager launches"
