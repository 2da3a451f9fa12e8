"""Paged decode attention in Triton: one program per (sequence, kv head), online softmax over the
sequence's blocks, the query heads of the group handled together. Reads only the real context."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, scale,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                         GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    q = tl.load(q_ptr + b * stride_qb + (kvh * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < ctx
        block = tl.load(bt_ptr + b * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = block * stride_kb + (n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale      # [G, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + b * stride_ob + (kvh * GROUP + g)[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D]; caches [blocks, block_size, Hkv, D]; -> [B, Hq, D]."""
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    _paged_decode_kernel[(B, Hkv)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=D, GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 1),
        BLOCK_N=64 if D <= 64 else 32, num_warps=4)
    return out
