"""The Triton varlen paged prefill kernel against the per-sequence SDPA loop (torch_prefill), and its batch
invariance. On CPU it runs in the Triton interpreter (small sizes: the interpreter is slow); with CUDA the
same checks also run compiled, in fp32 and bf16, plus one at the real model's sizes. The whole file takes
~4 s of test time on 2 CPU cores (plus ~15 s of pytest start-up and imports)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported: kernels are defined at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="the Triton prefill kernel needs triton")

from nano_qwen3tts_vllm.layers.attention import PagedMetadata, store_kv, torch_prefill  # noqa: E402

# (new tokens, context) per sequence: no prefix, a prefix, prefixes not aligned to the tiles, several tiles
SEQS = [(1, 1), (5, 5), (17, 17), (40, 40), (3, 35), (20, 52), (1, 30), (70, 83)]


def build(seqs: list[tuple[int, int]], *, heads: int = 4, kv_heads: int = 2, head_dim: int = 64, block_size: int = 16,
          dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Each sequence's q/k/v are drawn from a seed of its own (the same values in any batch), its context is
    written to shuffled cache blocks; unused cache rows are NaN so that any read outside a context shows."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(seqs), max(widths) + 1), num_blocks, dtype=torch.int32)  # padded with scratch
    cache = torch.full((2, num_blocks + 1, block_size, kv_heads, head_dim), float("nan"))
    qs, ks, vs = [], [], []
    for i, ((n, ctx), width) in enumerate(zip(seqs, widths)):
        tables[i, :width] = torch.tensor(perm[:width], dtype=torch.int32)
        perm = perm[width:]
        gs = torch.Generator().manual_seed(seed * 1_000_003 + n * 1009 + ctx)
        k, v = torch.randn(2, ctx, kv_heads, head_dim, generator=gs)
        qs.append(torch.randn(n, heads, head_dim, generator=gs))
        pos = torch.arange(ctx)
        store_kv(k, v, cache[0], cache[1], tables[i, pos // block_size].long() * block_size + pos % block_size)
        ks.append(k[ctx - n:])
        vs.append(v[ctx - n:])
    n_q = [n for n, _ in seqs]
    t = dict(q=torch.cat(qs), k=torch.cat(ks), v=torch.cat(vs), k_cache=cache[0], v_cache=cache[1],
             block_tables=tables, cu_seqlens_q=torch.tensor([0] + n_q).cumsum(0).int(),
             seqlens_k=torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32))
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in t.items()}


def triton_prefill(t: dict[str, torch.Tensor], seqs: list[tuple[int, int]]) -> torch.Tensor:
    from nano_qwen3tts_vllm.layers.triton_prefill import paged_prefill
    scale = t["q"].shape[-1] ** -0.5
    return paged_prefill(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["cu_seqlens_q"], t["seqlens_k"],
                         max(n for n, _ in seqs), scale)


def reference(t: dict[str, torch.Tensor], seqs: list[tuple[int, int]]) -> torch.Tensor:
    """fp32 per-sequence SDPA on the same (possibly bf16-rounded) inputs."""
    f = {k: v.float() if v.is_floating_point() else v for k, v in t.items()}
    meta = PagedMetadata(is_prefill=True, slot_mapping=None, block_tables=f["block_tables"],
                         seqlens_q=[n for n, _ in seqs], seqlens_k=[ctx for _, ctx in seqs])
    return torch_prefill(f["q"], f["k"], f["v"], f["k_cache"], f["v_cache"], meta, t["q"].shape[-1] ** -0.5)


def cases() -> list:
    # fp16 covers the half-precision path on CPU: the interpreter's tl.dot is wrong for bf16 (it multiplies
    # the raw bits), so bf16 is checked on CUDA only
    if torch.cuda.is_available():  # compiled: CPU tensors cannot reach the kernels
        out = [("cuda", torch.float32), ("cuda", torch.bfloat16)]
    else:
        out = [("cpu", torch.float32), ("cpu", torch.float16)]
    return [pytest.param(device, dtype, id=f"{device}-{str(dtype).removeprefix('torch.')}") for device, dtype in out]


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        rel = (out.float() - ref).norm() / ref.norm()
        assert rel < 1e-2, rel


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 2, 16), (3, 1, 32)])
def test_paged_prefill_matches_torch_prefill(device, dtype, heads, kv_heads, block_size):
    t = build(SEQS, heads=heads, kv_heads=kv_heads, block_size=block_size, dtype=dtype, device=device)
    check_close(triton_prefill(t, SEQS), reference(t, SEQS).to(device), dtype)


@pytest.mark.parametrize("device,dtype", cases())
def test_paged_prefill_is_batch_invariant(device, dtype):
    target = (20, 52)  # 20 new tokens after a 32-token cached prefix
    alone = triton_prefill(build([target], dtype=dtype, device=device), [target])
    # other lengths before and after it, a longer max_seqlen_q, other cache blocks
    for batch in ([(70, 83), target], [(1, 1), (33, 33), target, (5, 40)], [target, (1, 1)]):
        out = triton_prefill(build(batch, dtype=dtype, device=device), batch)
        lo = sum(n for n, _ in batch[:batch.index(target)])
        assert torch.equal(out[lo:lo + target[0]], alone), batch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the interpreter is too slow for it)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 256])
def test_paged_prefill_at_model_sizes(dtype, block_size):
    seqs = [(1, 1), (63, 63), (64, 64), (65, 65), (130, 130), (7, 300), (200, 457), (129, 129)]
    t = build(seqs, heads=16, kv_heads=8, head_dim=128, block_size=block_size, dtype=dtype, device="cuda")
    check_close(triton_prefill(t, seqs), reference(t, seqs), dtype)
