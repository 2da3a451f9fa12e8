"""The small-batch GEMV kernel (layers/triton_linear.py) against torch: plain, with bias, with SiLU(gate) * up, and
with the add + RMSNorm prologue. On CPU it runs in the Triton interpreter (conftest sets TRITON_INTERPRET)."""
import pytest
import torch
import torch.nn.functional as F

from nano_qwen3tts_vllm.layers.fused import add_rms_norm, rms_norm, silu_and_mul
from nano_qwen3tts_vllm.layers.triton_linear import embedding_gemv, gemv, norm_gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _data(n: int, k: int, dtype: torch.dtype, seed: int = 0, rows: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g)
    return [t.to(DEVICE, dtype) for t in (x, w, b)]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("config", [(4, 64, 4), (8, 256, 4), (1, 32, 2)])  # one K step, several, N not a multiple
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_equals_linear(dtype, atol, config, rows):
    x, w, b = _data(52, 200, dtype, rows=rows)
    torch.testing.assert_close(gemv(x, w, config=config), F.linear(x, w), atol=atol, rtol=atol)
    torch.testing.assert_close(gemv(x, w, b, config=config), F.linear(x, w, b), atol=atol, rtol=atol)
    gate_up = w[:48]
    torch.testing.assert_close(gemv(x, gate_up, silu_mul=True, config=config),
                               silu_and_mul(F.linear(x, gate_up)), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_norm_gemv_equals_add_rms_norm_then_linear(dtype, atol, silu_mul, rows):
    x, w, _ = _data(48, 200, dtype, rows=rows)
    residual, norm_w, _ = _data(200, 200, dtype, seed=1, rows=rows)
    norm_w = norm_w[0] + 1.0
    act = (lambda y: silu_and_mul(y)) if silu_mul else (lambda y: y)

    y, res = norm_gemv(x, residual, norm_w, 1e-6, w, silu_mul)
    ref_res, normed = add_rms_norm(x, residual, norm_w, 1e-6)
    if dtype == torch.float32 or DEVICE == "cuda":  # the interpreter rounds float32 -> bfloat16 towards zero
        assert torch.equal(res, ref_res)  # the new residual stream is written exactly
    torch.testing.assert_close(res, ref_res, atol=atol, rtol=atol)
    torch.testing.assert_close(y, act(F.linear(normed, w)), atol=atol, rtol=atol)

    y, res = norm_gemv(x, None, norm_w, 1e-6, w, silu_mul)  # first layer: no residual yet
    assert res is x or torch.equal(res, x)
    torch.testing.assert_close(y, act(F.linear(rms_norm(x, norm_w, 1e-6), w)), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("rows", [1, 2])
def test_embedding_gemv_gathers_its_rows(dtype, atol, rows):
    """The predictor's codebook step: table rows ids + offset, projected with bias, in one kernel."""
    table, w, b = _data(64, 96, dtype, rows=30)
    ids = torch.tensor([7, 2][:rows], device=DEVICE)
    expected = F.linear(F.embedding(ids + 11, table), w, b)
    torch.testing.assert_close(embedding_gemv(ids, 11, table, w, b), expected, atol=atol, rtol=atol)
    assert torch.equal(embedding_gemv(ids, 11, table, w, b), gemv(table[ids + 11], w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_its_batch(dtype):
    x, w, b = _data(40, 300, dtype, rows=5)
    residual, norm_w, _ = _data(300, 300, dtype, seed=1, rows=5)
    norm_w = norm_w[0] + 1.0
    batch = gemv(x, w, b, config=(8, 128, 4))
    normed, summed = norm_gemv(x, residual, norm_w, 1e-6, w, silu_mul=True)
    for i in range(5):
        assert torch.equal(gemv(x[i:i + 1], w, b, config=(8, 128, 4))[0], batch[i])
        one, one_sum = norm_gemv(x[i:i + 1], residual[i:i + 1], norm_w, 1e-6, w, silu_mul=True)
        assert torch.equal(one[0], normed[i]) and torch.equal(one_sum[0], summed[i])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check; on a GPU small-batch steps take the "
                    "kernel by default and test_gpu.py checks the engine")
def test_engine_frames_unchanged_with_the_gemv_kernel(ckpt, ours, monkeypatch):
    """Greedy fp32, one request decoding alone (talker and predictor steps of one row, the predictor's first step
    of two): the GEMV kernels, with the norms fused into the qkv and gate/up projections, give the torch path's
    frames."""
    from test_batching import TEXTS, new_engine, run
    from conftest import GREEDY
    from nano_qwen3tts_vllm.layers import triton_linear
    from nano_qwen3tts_vllm.models import qwen3
    model_dir = ckpt("tiny-random")
    job = ours(model_dir)._custom_voice_jobs(TEXTS[0], "vivian", "english", None, True,
                                            dict(max_new_tokens=3, **GREEDY))[0]
    requests, schedule = [(job.prompt, job.params)], {0: [0]}
    expected = run(new_engine(model_dir), requests, schedule)
    calls = []

    def on_cpu_too(x, weight, rows=None):
        rows = x.numel() // x.shape[-1] if rows is None else rows
        ok = rows <= triton_linear.MAX_ROWS and x.dtype == weight.dtype
        calls.append(ok)
        return ok
    for module in (triton_linear, qwen3):
        monkeypatch.setattr(module, "uses_gemv", on_cpu_too)
    assert run(new_engine(model_dir), requests, schedule) == expected
    assert sum(calls) > 100  # the decode steps did go through the kernel
