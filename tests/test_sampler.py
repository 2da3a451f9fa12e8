"""Unit tests for nano_qwen3tts_vllm.engine.sampler, checked against the transformers processors
that qwen-tts's HF `generate` uses (CPU only, fast)."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nano_qwen3tts_vllm.engine.sampler import SamplingTensors, apply_penalties, sample, uniform_noise, warp

EOS = 2150
TALKER_VOCAB = 3072
SUPPRESSED = [i for i in range(2048, TALKER_VOCAB) if i != EOS]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _st(rows: list[tuple[bool, float, int, float, int]]) -> SamplingTensors:
    """rows of (do_sample, temperature, top_k, top_p, seed)."""
    do_sample, temp, top_k, top_p, seeds = zip(*rows)
    return SamplingTensors(torch.tensor(do_sample), torch.tensor(temp, dtype=torch.float32),
                           torch.tensor(top_k, dtype=torch.long), torch.tensor(top_p, dtype=torch.float32),
                           torch.tensor(seeds, dtype=torch.long))


def _hf_warp_row(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' warpers on one [V] row, skipping each one exactly when `generate` would not add it."""
    scores = row[None, :].clone()
    ids = torch.zeros(1, 0, dtype=torch.long)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores[0]


def _noise_is_one_case():
    """(seed, counter, column) whose hash has all its top bits set: the largest noise value there is
    (found by scanning counters 0..39999 for seed 1234 at vocab 3072); it used to round to exactly 1.0."""
    return 1234, 6123, 1477


# ----------------------------------------------------------------------------------------------------------
# 1. apply_penalties == RepetitionPenalty -> MinNewTokensLength -> SuppressTokens
# ----------------------------------------------------------------------------------------------------------

def test_apply_penalties_matches_transformers():
    g = _gen(0)
    V = TALKER_VOCAB
    logits = torch.randn(6, V, generator=g) * 4          # both signs
    logits[:, :16] = 0.0                                 # exact zeros (neither < 0 nor changed by /p)
    penalties = [1.05, 1.3, 0.8, 1.0, 2.0, 0.5]
    min_new_tokens = [2, 10, 0, 5, 50, 3]
    lengths = [0, 7, 40, 5, 120, 1]
    histories = []
    for n in lengths:
        h = torch.randint(0, 2048, (n,), generator=g)
        if n >= 4:                                       # repeated ids, EOS and suppressed ids in the history
            h[1] = h[0]
            h[2] = EOS
            h[3] = 2500
        h[h < 16] = 5 if n else 0                        # some zero logits are seen
        histories.append(h)
    block_eos = torch.tensor([len(h) < m for h, m in zip(histories, min_new_tokens)])
    assert block_eos.any() and not block_eos.all()

    seen = torch.zeros(6, V, dtype=torch.bool)
    for r, h in enumerate(histories):
        seen[r, h] = True
    suppress = torch.zeros(V, dtype=torch.bool)
    suppress[SUPPRESSED] = True

    got = apply_penalties(logits.clone(), seen, torch.tensor(penalties), block_eos, EOS, suppress)

    expected = []
    for r, h in enumerate(histories):
        ids, scores = h[None, :], logits[r:r + 1].clone()
        scores = RepetitionPenaltyLogitsProcessor(penalties[r])(ids, scores)
        scores = MinNewTokensLengthLogitsProcessor(0, min_new_tokens[r], EOS)(ids, scores)
        scores = SuppressTokensLogitsProcessor(SUPPRESSED)(ids, scores)
        expected.append(scores[0])
    expected = torch.stack(expected)

    assert torch.equal(got, expected)
    # the cases the test is meant to cover did occur
    assert torch.isneginf(got[block_eos, EOS]).all() and torch.isfinite(got[~block_eos, EOS]).all()
    assert torch.isneginf(got[:, SUPPRESSED]).all()
    for r in (0, 1, 2, 4, 5):                            # rows whose penalty is not 1 and whose history is not empty
        if len(histories[r]):
            changed = got[r, :2048] != logits[r, :2048]
            assert changed.any() and (changed <= seen[r, :2048]).all()


def test_penalty_one_leaves_logits_unchanged():
    g = _gen(1)
    logits = torch.randn(3, TALKER_VOCAB, generator=g) * 3
    seen = torch.rand(3, TALKER_VOCAB, generator=g) < 0.5
    no_suppress = torch.zeros(TALKER_VOCAB, dtype=torch.bool)
    got = apply_penalties(logits.clone(), seen, torch.tensor([1.0, 1.5, 1.0]), torch.zeros(3, dtype=torch.bool),
                          EOS, no_suppress)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])          # the neighbouring row with penalty 1.5 did change


# ----------------------------------------------------------------------------------------------------------
# 2. warp == Temperature -> TopK -> TopP, per row
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("V", [3072, 2048])
def test_warp_matches_transformers_per_row(V):
    g = _gen(V)
    settings = [                     # (temperature, top_k, top_p)
        (0.7, 50, 0.9),
        (1.0, 0, 1.0),               # everything off: unchanged
        (1.3, V + 1000, 0.8),        # top_k larger than the vocabulary
        (0.5, 1, 1.0),               # top_k = 1
        (1.0, 0, 1e-6),              # tiny top_p: only the top token survives
        (0.9, 20, 1.0),              # ties at the 20th value (below)
        (2.0, 100, 0.5),
        (1.0, 7, 0.95),
        (0.8, 0, 0.0),               # top_p = 0: transformers still keeps the top token
    ]
    logits = torch.randn(len(settings), V, generator=g) * 2
    # row 5: the 18 largest values are distinct, then 5 tokens share the 19th..23rd largest value
    ties_row = torch.randn(V, generator=g)
    top = torch.linspace(10.0, 6.0, 18)
    idx = torch.randperm(V, generator=g)
    ties_row[idx[:18]] = top
    ties_row[idx[18:23]] = 5.0
    logits[5] = ties_row

    st = _st([(True, t, k, p, 0) for t, k, p in settings])
    got = warp(logits.clone(), st)

    for r, (t, k, p) in enumerate(settings):
        exp = _hf_warp_row(logits[r], t, k, p)
        assert torch.equal(torch.isinf(got[r]), torch.isinf(exp)), f"row {r}: -inf positions differ"
        assert torch.isneginf(got[r][torch.isinf(got[r])]).all()
        fin = torch.isfinite(exp)
        torch.testing.assert_close(got[r][fin], exp[fin], rtol=0, atol=1e-6, msg=f"row {r}")

    n_kept = torch.isfinite(got).sum(dim=1)
    assert n_kept[1] == V and torch.equal(got[1], logits[1])
    assert n_kept[3] == 1 and got[3].argmax() == logits[3].argmax()
    assert n_kept[4] == 1 and got[4].argmax() == logits[4].argmax()
    assert n_kept[8] == 1 and got[8].argmax() == logits[8].argmax()
    assert n_kept[5] == 23                               # top-k kept all five tied tokens
    assert 1 < n_kept[0] < 50 and 1 < n_kept[6] < 100    # top-p did cut inside the top-k set


def test_top_p_is_applied_after_temperature_and_top_k():
    """Small hand-checked case: temperature changes which tokens top-p keeps, top-k renormalises first."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]] * 3)
    st = _st([(True, 1.0, 0, 0.9, 0), (True, 0.25, 0, 0.9, 0), (True, 1.0, 2, 0.8, 0)])
    kept = torch.isfinite(warp(logits, st))
    # T=1: probs .636 .234 .086 ... -> the top 3 reach 0.9;  T=0.25: p(top) = .98 -> only the top one;
    # top_k=2 then top_p=0.8 over the renormalised pair (.731, .269) -> both kept.
    assert kept.tolist() == [[True, True, True, False, False, False],
                             [True, False, False, False, False, False],
                             [True, True, False, False, False, False]]


def test_top_p_threshold_is_inclusive():
    """Four equal logits have cumulative probabilities exactly .25 .5 .75 1: a token whose cumulative
    probability equals 1 - top_p is removed (transformers uses <=)."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, float("-inf")]] * 3)
    st = _st([(True, 1.0, 0, 0.5, 0), (True, 1.0, 0, 0.75, 0), (True, 1.0, 0, 0.25, 0)])
    got = warp(logits, st)
    expected = [_hf_warp_row(logits[r], 1.0, 0, p) for r, p in enumerate((0.5, 0.75, 0.25))]
    assert [int(torch.isfinite(e).sum()) for e in expected] == [2, 3, 1]
    assert torch.isfinite(got).sum(dim=1).tolist() == [2, 3, 1]


def test_top_p_one_keeps_the_probabilities_of_extreme_logits():
    """With top_p = 1 transformers adds no top-p warper. warp may mask tokens whose float32 probability
    underflows to 0, but the distribution sampled from must be the same."""
    logits = torch.tensor([[0.0, -120.0, -5.0, -200.0, 3.0, -90.0]])
    st = _st([(True, 1.0, 0, 1.0, 0)])
    expected = _hf_warp_row(logits[0], 1.0, 0, 1.0)
    assert torch.equal(warp(logits, st)[0].softmax(-1), expected.softmax(-1))


# ----------------------------------------------------------------------------------------------------------
# 3. greedy rows
# ----------------------------------------------------------------------------------------------------------

def test_greedy_rows_return_argmax_in_mixed_batch():
    g = _gen(3)
    V = 2048
    rows = [(False, 1.0, 0, 1.0, 11), (True, 3.0, 0, 1.0, 12), (False, 0.7, 30, 0.8, 13),
            (True, 2.5, 500, 0.99, 14), (False, 1.0, 0, 1.0, 15), (True, 4.0, 0, 1.0, 16)]
    st = _st(rows)
    greedy = ~st.do_sample
    logits = torch.randn(len(rows), V, generator=g)
    n_steps = 200
    sampled_is_argmax = []
    for counter in range(n_steps):
        tok = sample(logits, st, torch.full((len(rows),), counter))
        assert torch.equal(tok[greedy], logits[greedy].argmax(dim=-1))
        sampled_is_argmax.append(tok[~greedy] == logits[~greedy].argmax(dim=-1))
    # the sampled rows of the same batch really did sample (hot temperatures over 2048 tokens)
    assert torch.stack(sampled_is_argmax).float().mean() < 0.2


def test_greedy_uses_unwarped_logits():
    """A greedy row takes the argmax of the logits it is given, whatever its (ignored) sampling settings."""
    logits = torch.tensor([[0.0, 5.0, 4.9, -1.0], [2.0, -3.0, 1.0, 1.99]])
    st = _st([(False, 0.1, 1, 0.01, 7), (False, 10.0, 3, 1.0, 8)])
    assert sample(logits, st, torch.tensor([0, 0])).tolist() == [1, 0]


# ----------------------------------------------------------------------------------------------------------
# 4. the sampled distribution
# ----------------------------------------------------------------------------------------------------------

def _chisquare_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    try:
        from scipy.stats import chi2
        return float(chi2.sf(stat, dof))
    except ImportError:                                  # Wilson-Hilferty approximation of the chi2 tail
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("V,temperature,top_k,top_p,seed", [
    (16, 0.7, 5, 0.9, 42),
    (8, 1.0, 0, 1.0, 7),
    (16, 1.5, 0, 0.7, 2**40 + 3),
])
def test_sampled_frequencies_follow_warped_softmax(V, temperature, top_k, top_p, seed):
    g = _gen(V)
    base = torch.randn(V, generator=g) * 1.5
    n = 20000
    logits = base.expand(n, V).contiguous()
    st = _st([(True, temperature, top_k, top_p, seed)] * n)
    tokens = sample(logits, st, torch.arange(n))

    assert_follows_warped_softmax(tokens, base, temperature, top_k, top_p)


def assert_follows_warped_softmax(tokens: torch.Tensor, base: torch.Tensor, temperature: float, top_k: int,
                                  top_p: float) -> None:
    """`tokens`, n draws from the logits `base` [V], never leave transformers' top-k/top-p set and follow its
    warped softmax (chi-square)."""
    n, V = tokens.numel(), base.numel()
    probs = _hf_warp_row(base, temperature, top_k, top_p).softmax(-1).double()
    support = probs > 0
    if top_k or top_p < 1:
        assert support.sum() < V                         # the filters did remove tokens
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[~support].sum() == 0, "a token outside the top-k/top-p set was sampled"
    assert counts[support].min() > 0

    pvalue = _chisquare_pvalue(counts[support], probs[support] * n)
    assert pvalue > 1e-3, f"chi-square p = {pvalue}: counts {counts[support].tolist()}, " \
                          f"expected {(probs[support] * n).tolist()}"


# ----------------------------------------------------------------------------------------------------------
# 5. counter-based noise and seeds
# ----------------------------------------------------------------------------------------------------------

def test_same_seed_and_counter_give_same_token_whatever_the_batch():
    g = _gen(5)
    V = TALKER_VOCAB
    # six requests, each with its own logits, settings, seed and counter
    reqs = [((True, 1.5, 0, 1.0, 101), 0), ((True, 0.9, 200, 0.95, 102), 17), ((True, 2.0, 0, 0.99, -5), 3),
            ((False, 1.0, 0, 1.0, 104), 9), ((True, 1.2, 1000, 1.0, 2**33 + 1), 123456), ((True, 3.0, 0, 1.0, 0), 1)]
    req_logits = torch.randn(len(reqs), V, generator=g)

    def run(order: list[int], extra: int = 0) -> dict[int, int]:
        rows = [reqs[i][0] for i in order] + [(True, 1.0, 0, 1.0, 999 + j) for j in range(extra)]
        counters = [reqs[i][1] for i in order] + list(range(extra))
        lg = torch.cat([req_logits[order], torch.randn(extra, V, generator=g)])
        tok = sample(lg, _st(rows), torch.tensor(counters))
        noise = uniform_noise(_st(rows).seeds, torch.tensor(counters), V)
        for pos, i in enumerate(order):                  # the noise itself is also per (seed, counter) only
            assert torch.equal(noise[pos], uniform_noise(torch.tensor([reqs[i][0][4]]),
                                                         torch.tensor([reqs[i][1]]), V)[0])
        return {i: int(tok[pos]) for pos, i in enumerate(order)}

    alone = {}
    for i in range(len(reqs)):
        alone.update(run([i]))
    assert run(list(range(len(reqs)))) == alone
    assert run([5, 3, 1, 0, 4, 2], extra=3) == alone
    assert run([4, 2], extra=5) == {i: alone[i] for i in (4, 2)}
    # the sampled requests did not just take the argmax (so the equalities above test the noise)
    argmax = req_logits.argmax(-1)
    assert sum(alone[i] != int(argmax[i]) for i in (0, 2, 5)) >= 2


def test_different_seeds_give_different_token_sequences():
    g = _gen(6)
    V, n = 2048, 300
    logits = torch.randn(1, V, generator=g).expand(n, V)
    counters = torch.arange(n)

    def seq(seed: int) -> torch.Tensor:
        return sample(logits, _st([(True, 1.0, 0, 1.0, seed)] * n), counters)

    a, b = seq(1), seq(2)
    assert torch.equal(a, seq(1))                        # reproducible
    assert (a == b).float().mean() < 0.05
    assert len(set(a.tolist())) > 100                    # the counter moves the draw too


def test_uniform_noise_statistics():
    n_counters, V = 4000, 1024
    u = uniform_noise(torch.full((n_counters,), 77), torch.arange(n_counters), V).double()
    assert u.dtype == torch.float64 and u.shape == (n_counters, V)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 2e-3
    assert abs(u.var() - 1 / 12) < 2e-3
    hist = torch.histc(u, bins=64, min=0, max=1)
    assert _chisquare_pvalue(hist, torch.full((64,), u.numel() / 64.0)) > 1e-3

    def corr(x: torch.Tensor, y: torch.Tensor) -> float:
        return float(torch.corrcoef(torch.stack([x, y]))[0, 1])

    # neighbouring columns, neighbouring counters, neighbouring seeds: uncorrelated
    assert abs(corr(u[:, 0], u[:, 1])) < 0.05
    assert abs(corr(u[:, 10], u[:, 11])) < 0.05
    assert abs(corr(u[:-1, 0], u[1:, 0])) < 0.05
    u78 = uniform_noise(torch.full((n_counters,), 78), torch.arange(n_counters), 2).double()
    assert abs(corr(u[:, 0], u78[:, 0])) < 0.05
    # and a column's values over counters are uniform too (not just the pooled sample)
    assert abs(u[:, 0].mean() - 0.5) < 0.02


def test_seeds_differing_only_in_high_bits_give_different_noise():
    V = 2048
    low = 12345
    seeds = torch.tensor([low, low + (1 << 32), low + (1 << 40), low + (1 << 62), low - (1 << 63)])
    counters = torch.zeros(len(seeds), dtype=torch.long)
    u = uniform_noise(seeds, counters, V)
    for i in range(len(seeds)):
        for j in range(i + 1, len(seeds)):
            assert (u[i] == u[j]).float().mean() < 0.01, f"seeds {int(seeds[i])} and {int(seeds[j])}"


def test_uniform_noise_is_strictly_below_one():
    """Regression: with 24 bits, (2**24-1) + 0.5 rounded to 2**24 in float32 and the noise reached 1.0."""
    seed, counter, col = _noise_is_one_case()
    u = uniform_noise(torch.tensor([seed]), torch.tensor([counter]), TALKER_VOCAB)
    assert 1.0 - 2.0 ** -23 < u[0, col] < 1.0          # the extreme value, and still below 1


def test_filtered_token_is_never_sampled_even_at_noise_one():
    """Regression: noise 1.0 gave -log(noise) = -0.0, so a filtered token scored 0/-0.0 = NaN and won."""
    seed, counter, col = _noise_is_one_case()
    g = _gen(8)
    logits = torch.randn(1, TALKER_VOCAB, generator=g)
    top = int(logits.argmax())
    assert top != col
    tok = sample(logits, _st([(True, 1.0, 1, 1.0, seed)]), torch.tensor([counter]))   # top_k = 1
    assert int(tok) == top


# ----------------------------------------------------------------------------------------------------------
# 6. edge cases
# ----------------------------------------------------------------------------------------------------------

def test_single_finite_token_is_always_chosen():
    V = TALKER_VOCAB
    targets = [0, 2150, 3071, 777, 1500, 42]
    logits = torch.full((len(targets), V), float("-inf"))
    for r, t in enumerate(targets):
        logits[r, t] = -50.0 + 10 * r                    # any value, even very negative
    rows = [(False, 1.0, 0, 1.0, 1), (True, 1.0, 0, 1.0, 2), (True, 0.3, 1, 1.0, 3),
            (True, 2.0, 50, 0.5, 4), (True, 1.0, 0, 1e-6, 5), (False, 1.0, 0, 1.0, 6)]
    st = _st(rows)
    for counter in range(20):
        tok = sample(logits, st, torch.full((len(rows),), counter))
        assert tok.tolist() == targets
