"""The one-kernel Triton sampler (layers/triton_sampler.py) against the torch sampler `_sample` it replaces on
CUDA. On CPU the kernel runs in the Triton interpreter (conftest sets TRITON_INTERPRET), which takes ~10-60 ms
a row: batches here are small. The cuda variants run the same checks on a GPU (compiled kernel)."""
from __future__ import annotations

import math

import pytest
import torch

from nano_qwen3tts_vllm.engine import sampler
from nano_qwen3tts_vllm.engine.sampler import (SamplingTensors, _column_hash, _sample, _warp, apply_penalties, sample,
                                               uniform_noise)

pytest.importorskip("triton", reason="the Triton sampler needs triton")
from nano_qwen3tts_vllm.layers.triton_sampler import triton_sample  # noqa: E402
from test_sampler import assert_follows_warped_softmax  # noqa: E402  (the transformers oracle, chi-square)

CUDA = torch.cuda.is_available()
CPU_ONLY = pytest.mark.skipif(CUDA, reason="compiled Triton rejects CPU tensors: the cuda variant runs instead")
CUDA_ONLY = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the cpu variant runs the kernel interpreted)")
DEVICES = [pytest.param("cpu", marks=CPU_ONLY), pytest.param("cuda", marks=CUDA_ONLY)]
EOS = 2150


def _st(rows, device="cpu") -> SamplingTensors:
    """rows of (do_sample, temperature, top_k, top_p, seed)."""
    do_sample, temp, top_k, top_p, seeds = zip(*rows)
    return SamplingTensors(torch.tensor(do_sample, device=device),
                           torch.tensor(temp, dtype=torch.float32, device=device),
                           torch.tensor(top_k, dtype=torch.long, device=device),
                           torch.tensor(top_p, dtype=torch.float32, device=device),
                           torch.tensor(seeds, dtype=torch.long, device=device))


def kernel(logits, st: SamplingTensors, counters, device, counter_offset: int = 0) -> torch.Tensor:
    """The kernel on `device`, result on the CPU."""
    st = SamplingTensors(*(t.to(device) for t in (st.do_sample, st.temperature, st.top_k, st.top_p, st.seeds)))
    if isinstance(counters, torch.Tensor):
        counters = counters.to(device)
    return triton_sample(logits.to(device), st.do_sample, st.temperature, st.top_k, st.top_p, st.seeds, counters,
                         counter_offset).cpu()


def torch_sampler(logits, st: SamplingTensors, counters) -> torch.Tensor:
    """`_sample`, the torch path, on the CPU."""
    return _sample(logits, st.do_sample, st.temperature, st.top_k, st.top_p, st.seeds, counters,
                   _column_hash(logits.shape[-1], "cpu"))


def stable_warp(logits, st: SamplingTensors) -> torch.Tensor:
    """`_warp` with a stable sort: tokens tied in value enter top-p's cumulative sum in index order, as torch's
    radix sort orders them on CUDA (the CPU sort leaves their order unspecified)."""
    V = logits.shape[-1]
    logits = logits / st.temperature[:, None]
    sorted_logits, sorted_idx = logits.sort(dim=-1, stable=True)
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=V), torch.full_like(st.top_k, V))
    kth = sorted_logits.gather(1, (V - k)[:, None])
    logits = logits.masked_fill(logits < kth, float("-inf"))
    cum = sorted_logits.masked_fill(sorted_logits < kth, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - st.top_p)[:, None]
    remove[:, -1] = False
    return logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))


def stable_sampler(logits, st: SamplingTensors, counters) -> torch.Tensor:
    """`_sample` with stable_warp."""
    probs = stable_warp(logits, st).softmax(dim=-1)
    sampled = (probs / -torch.log(uniform_noise(st.seeds, counters, logits.shape[-1]))).argmax(dim=-1)
    return torch.where(st.do_sample, sampled, logits.argmax(dim=-1))


def top_p_margin(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> float:
    """How far (float64) 1 - top_p lies from every cumulative mass top-p compares it with. A float32 sum of
    masses <= 1 is off by < 1e-6 whatever its order: a larger margin makes the kept set order-independent."""
    if top_p >= 1:
        return math.inf
    x = (row / temperature).double()
    V = x.numel()
    if 0 < top_k < V:
        x = x.masked_fill(x < x.sort().values[V - top_k], float("-inf"))
    cum = x.softmax(-1).sort().values.cumsum(-1)
    return float((cum[:-1] - (1 - top_p)).abs().min()) if V > 1 else math.inf


def row_cases(V: int, g: torch.Generator):
    """(logits [R, V], rows of (do_sample, temperature, top_k, top_p, seed)): every setting the kernel branches on."""
    settings = [
        (False, 1.0, 0, 1.0),          # greedy
        (False, 0.3, 5, 0.5),          # greedy, its sampling settings ignored
        (True, 1.0, 0, 1.0),           # everything off
        (True, 0.7, 50, 1.0),          # the usual top-k
        (True, 0.9, 50, 0.8),
        (True, 1.3, V + 1000, 0.8),    # top_k beyond the vocabulary
        (True, 1.1, V, 1.0),           # top_k = V
        (True, 0.5, 1, 1.0),           # top_k = 1
        (True, 1.0, 0, 1e-6),          # tiny top_p: only the top token
        (True, 0.8, 0, 0.0),           # top_p = 0: transformers still keeps the top token
        (True, 2.0, 100, 0.5),
        (True, 1.0, 7, 0.95),
        (True, 1.5, 0, 0.99),
        (True, 0.05, 0, 1.0),          # cold: nearly greedy
        (True, 0.9, 20, 1.0),          # ties at the 20th value (below)
        (True, 1.2, 50, 0.9),          # -inf entries (below)
        (True, 1.0, 50, 0.7),          # fewer finite tokens than top_k (below)
        (False, 1.0, 0, 1.0),          # greedy with a tied maximum (below)
    ]
    logits = torch.randn(len(settings), V, generator=g) * 2
    logits[13] *= 0.5
    # row 14: the 18 largest values are distinct, then 5 tokens share the 19th..23rd largest value
    idx = torch.randperm(V, generator=g)
    logits[14] = torch.randn(V, generator=g)
    logits[14, idx[:18]] = torch.linspace(10.0, 6.0, 18)
    logits[14, idx[18:23]] = 5.0
    # rows 15, 16: -inf as apply_penalties produces it (suppressed ids, a blocked EOS), then only 30 finite tokens
    seen = torch.rand(2, V, generator=g) < 0.1
    suppress = torch.zeros(V, dtype=torch.bool)
    suppress[V * 2 // 3:] = True
    suppress[min(EOS, V - 1)] = False
    logits[15:17] = apply_penalties(logits[15:17], seen, torch.tensor([1.3, 1.0]), torch.tensor([True, False]),
                                    EOS, suppress)
    finite = idx[idx < V * 2 // 3][:30]
    logits[16] = torch.full((V,), float("-inf")).index_copy(0, finite, logits[16, finite])
    # row 17: the maximum twice; argmax takes the first
    logits[17, idx[:2]] = logits[17].max() + 1
    seeds = [int(s) for s in torch.randint(-2**62, 2**62, (len(settings),), generator=g)]
    seeds[2], seeds[3] = 0, -5
    return logits, [(d, t, k, p, s) for (d, t, k, p), s in zip(settings, seeds)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [2048, 3072])
def test_kernel_matches_torch_sampler(V, device):
    g = torch.Generator().manual_seed(V)
    logits, rows = row_cases(V, g)
    st = _st(rows)
    for r, (_, t, k, p, _) in enumerate(rows):  # no cumulative mass within float rounding of 1 - top_p
        assert top_p_margin(logits[r], t, k, p) > 5e-6, f"row {r}: the test data hit a float near-tie"
    assert torch.isneginf(logits[15]).any() and torch.isfinite(logits[16]).sum() == 30
    warped = _warp(logits, st.temperature, st.top_k, st.top_p)
    assert torch.isfinite(warped[14]).sum() == 23          # the top-k tie row keeps all five tied tokens
    n_calls = 4 if device == "cpu" else 64
    counters = torch.randint(0, 2**40, (n_calls, len(rows)), generator=g)
    counters[0] = 0
    differs_from_argmax = 0
    for c in counters:
        got = kernel(logits, st, c, device)
        expected = torch_sampler(logits, st, c)
        assert got.tolist() == expected.tolist(), f"counters {c.tolist()}"
        differs_from_argmax += int((got != logits.argmax(-1)).sum())
        if device == "cuda":  # and the compiled torch path on the GPU (stable sort there)
            assert got.tolist() == torch_sampler_cuda(logits, st, c).tolist()
    assert got[17] == (logits[17] == logits[17].max()).nonzero()[0, 0]
    assert differs_from_argmax > n_calls                   # the sampled rows did sample


def torch_sampler_cuda(logits, st, counters) -> torch.Tensor:
    st = SamplingTensors(*(t.cuda() for t in (st.do_sample, st.temperature, st.top_k, st.top_p, st.seeds)))
    return _sample(logits.cuda(), st.do_sample, st.temperature, st.top_k, st.top_p, st.seeds, counters.cuda(),
                   _column_hash(logits.shape[-1], "cuda:0")).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_ties_at_the_boundary_follow_the_stable_sort(device):
    """A group of equal values straddling the top-p boundary: the kernel removes the lower indices of the group
    first, as the stable ascending sort does; `_warp` keeps as many of them (which ones, its CPU sort leaves open)."""
    V = 2048
    g = torch.Generator().manual_seed(11)
    tied = torch.randperm(V, generator=g)[:7]
    # (a) four equal logits, cumulative masses exactly .25 .5 .75 1: top_p .5 keeps the last two indices
    a = torch.full((V,), float("-inf"))
    a[tied[:4]] = 0.0
    # (b) two top tokens, five tokens tied at 2.0, a random tail; top_p puts the boundary half-way through the
    # third tied token in index order, so the first two tied tokens are removed and the last three kept
    b = torch.randn(V, generator=g) - 3
    b[tied[0]], b[tied[1]], b[tied[2:]] = 4.0, 3.5, 2.0
    group = sorted(tied[2:].tolist())

    def half_way(top_k: int) -> float:
        x = b if top_k == 0 else b.masked_fill(b < b.sort().values[V - top_k], float("-inf"))
        q = torch.softmax(x.double(), -1)
        return 1 - (float(q[x < 2.0].sum()) + 2.5 * float(q[group[0]]))

    logits = torch.stack([a, b, b])
    rows = [(True, 1.0, 0, 0.5, 3), (True, 1.0, 0, half_way(0), 4), (True, 1.0, 100, half_way(100), 5)]
    st = _st(rows)
    kept = torch.isfinite(stable_warp(logits, st))
    assert kept[0].nonzero()[:, 0].tolist() == sorted(tied[:4].tolist())[2:]
    for r in (1, 2):
        assert kept[r, group].tolist() == [False, False, True, True, True] and kept[r, tied[:2]].all()
        assert kept[r].sum() == 5
    assert torch.equal(torch.isfinite(_warp(logits, st.temperature, st.top_k, st.top_p)).sum(-1), kept.sum(-1))
    seen = [set(), set(), set()]
    for c in range(8 if device == "cpu" else 256):
        counters = torch.full((3,), c)
        got = kernel(logits, st, counters, device)
        assert got.tolist() == stable_sampler(logits, st, counters).tolist()
        for r in range(3):
            assert kept[r, got[r]]
            seen[r].add(int(got[r]))
    assert len(seen[0]) == 2 and len(seen[1]) >= 2 and len(seen[2]) >= 2


@pytest.mark.parametrize("device", DEVICES)
def test_counters_per_row_shared_or_strided(device):
    """counters [B], one shared value (int, 0-d or 1-element tensor) and a strided column (as the runners slice
    them from their row tables); logits with a row stride wider than V."""
    V, B = 2048, 4
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(B, V + 64, generator=g)
    logits = wide[:, :V].contiguous()
    strided = wide.to(device)[:, :V]
    assert strided.stride(0) == V + 64
    st = _st([(True, 1.0, 0, 1.0, 10 + i) for i in range(B)])
    expected = torch_sampler(logits, st, torch.full((B,), 77))
    assert len(set(expected.tolist())) > 1
    for counters in (77, torch.tensor(77), torch.tensor([77]), torch.full((B,), 77)):
        assert kernel(strided, st, counters, device).tolist() == expected.tolist()
    table = torch.zeros(B, 6, dtype=torch.long)
    table[:, 2] = torch.tensor([5, 900, 2**35, 0])
    column = table.to(device)[:, 2]
    assert column.stride(0) == 6
    assert kernel(strided, st, column, device).tolist() == torch_sampler(logits, st, table[:, 2].clone()).tolist()
    # the predictor passes frame * 16 once and each codebook's k as counter_offset
    assert kernel(strided, st, column, device, 3).tolist() == torch_sampler(logits, st, table[:, 2] + 3).tolist()
    assert kernel(strided, st, 70, device, 7).tolist() == expected.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_single_finite_token_and_extreme_noise(device):
    """A row with one finite logit returns it whatever the settings; top_k = 1 returns the argmax even where
    the noise takes its largest value (seed 1234, counter 6123, column 1477: see test_sampler.py)."""
    V = 3072
    targets = [0, 2150, 3071, 777, 1500]
    logits = torch.full((len(targets) + 1, V), float("-inf"))
    for r, t in enumerate(targets):
        logits[r, t] = -50.0 + 10 * r
    logits[-1] = torch.randn(V, generator=torch.Generator().manual_seed(8))
    rows = [(False, 1.0, 0, 1.0, 1), (True, 1.0, 0, 1.0, 2), (True, 0.3, 1, 1.0, 3), (True, 2.0, 50, 0.5, 4),
            (True, 1.0, 0, 1e-6, 5), (True, 1.0, 1, 1.0, 1234)]
    st = _st(rows)
    assert uniform_noise(torch.tensor([1234]), torch.tensor([6123]), V)[0, 1477] > 1 - 2.0 ** -23
    for counter in (0, 6123):
        got = kernel(logits, st, torch.full((len(rows),), counter), device)
        assert got.tolist() == targets + [int(logits[-1].argmax())]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V,temperature,top_k,top_p,n_cpu", [
    (8, 1.3, 0, 1.0, 400),
    (16, 0.7, 5, 0.9, 150),
])
def test_sampled_frequencies_follow_warped_softmax(V, temperature, top_k, top_p, n_cpu, device):
    """Draws over many counters follow transformers' warped distribution (chi-square), and never leave it."""
    g = torch.Generator().manual_seed(V)
    base = torch.randn(V, generator=g) * 1.5
    n = n_cpu if device == "cpu" else 20000
    st = _st([(True, temperature, top_k, top_p, 42)] * n)
    tokens = kernel(base.expand(n, V), st, torch.arange(n), device)
    assert_follows_warped_softmax(tokens, base, temperature, top_k, top_p)


def test_sample_dispatch(monkeypatch):
    """sample() runs the kernel for CUDA tensors only, and NANO_QWEN3TTS_TRITON_SAMPLER=0 (TRITON_SAMPLER) turns
    it off; CPU tensors always take the torch path."""
    calls = []
    monkeypatch.setattr(sampler, "_triton_sample", lambda: lambda *a: calls.append(a) or triton_sample(*a))
    logits = torch.randn(2, 64)
    st = _st([(True, 1.0, 0, 1.0, 1), (False, 1.0, 0, 1.0, 2)])
    assert torch.equal(sample(logits, st, torch.tensor([3, 4])), torch_sampler(logits, st, torch.tensor([3, 4])))
    assert not calls
    if CUDA:
        st_cuda = _st([(True, 1.0, 0, 1.0, 1), (False, 1.0, 0, 1.0, 2)], "cuda")
        sample(logits.cuda(), st_cuda, torch.tensor([3, 4], device="cuda"))
        assert len(calls) == 1
        monkeypatch.setattr(sampler, "TRITON_SAMPLER", False)
        sample(logits.cuda(), st_cuda, torch.tensor([3, 4], device="cuda"))
        assert len(calls) == 1


@CUDA_ONLY
def test_kernel_in_a_cuda_graph():
    V, B = 2048, 8
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(B, V, generator=g) * 2).cuda()
    st = _st([(i % 3 != 0, 0.9, 50, 0.95 if i % 2 else 1.0, i) for i in range(B)], "cuda")
    counters = torch.zeros(B, dtype=torch.long, device="cuda")
    triton_sample(logits, st.do_sample, st.temperature, st.top_k, st.top_p, st.seeds, counters)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_sample(logits, st.do_sample, st.temperature, st.top_k, st.top_p, st.seeds, counters)
    for c in (0, 1, 99):
        counters.fill_(c)
        graph.replay()
        expected = triton_sample(logits, st.do_sample, st.temperature, st.top_k, st.top_p, st.seeds, counters)
        assert torch.equal(out, expected)
