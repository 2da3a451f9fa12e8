"""Varlen causal prefill attention over the paged KV cache in Triton: one launch per layer for the whole batch.

Flash-attention-2 forward (online softmax in fp32). One program handles a BLOCK_M tile of one sequence's
queries for one query head, and walks that sequence's keys in BLOCK_N tiles from position 0 through the
block table. The new tokens' k/v are already in the cache, so a cached prefix needs no special case.

Batch invariance: a program's work depends only on its own sequence (its query count, context length and
block table) and on constants fixed per (dtype, head_dim): its query tile starts at a multiple of BLOCK_M
within the sequence, its key tiles at multiples of BLOCK_N from position 0, in the same order. Nothing
depends on the other sequences or on max_seqlen_q (which only sizes the grid; programs past a sequence's
end return at once), so a sequence's output is bitwise identical alone or in any batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _attend(acc, l_i, m_i, q, qk_scale, pos, start, k_ptr, v_ptr, bt_row_ptr, kv_off, end, stride_kb, stride_ks,
            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
            CAUSAL_MASK: tl.constexpr, PRECISION: tl.constexpr):
    """Fold key tile [start, start + BLOCK_N) into the running (acc, l, m); qk_scale includes log2(e)."""
    n = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if CAUSAL_MASK:
        in_ctx = n < end  # the tile may run past the last key the tile's queries see (and past the table)
        block = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=in_ctx, other=0)
    else:
        block = tl.load(bt_row_ptr + n // BLOCK_SIZE)
    rows = block.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + kv_off
    if CAUSAL_MASK:
        k_t = tl.load(k_ptr + rows[None, :] + d[:, None], mask=in_ctx[None, :], other=0.0)   # [D, N]
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=in_ctx[:, None], other=0.0)     # [N, D]
    else:
        k_t = tl.load(k_ptr + rows[None, :] + d[:, None])
        v = tl.load(v_ptr + rows[:, None] + d[None, :])
    s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
    if CAUSAL_MASK:
        s = tl.where(n[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_q_ptr, lens_k_ptr, qk_scale,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
                          GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    n_q = tl.load(cu_q_ptr + b + 1) - q_start
    if tile * BLOCK_M >= n_q:
        return
    ctx = tl.load(lens_k_ptr + b)
    prefix = ctx - n_q
    m_idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = m_idx < n_q
    # rows past the sequence's end copy its last query's position: never an all-masked row, never stored
    pos = prefix + tl.minimum(m_idx, n_q - 1)
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + m_idx).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=m_valid[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    bt_row_ptr = bt_ptr + b * stride_bt
    kv_off = (h // GROUP) * stride_kh
    first = prefix + tile * BLOCK_M          # the tile's first query position
    end = tl.minimum(first + BLOCK_M, ctx)   # one past its last query position
    full_end = (first + 1) // BLOCK_N * BLOCK_N  # key tiles below this are visible to every row: no mask
    for start in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, qk_scale, pos, start, k_ptr, v_ptr, bt_row_ptr, kv_off, end,
                                stride_kb, stride_ks, BLOCK_SIZE, HEAD_DIM, BLOCK_N, False, PRECISION)
    for start in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, qk_scale, pos, start, k_ptr, v_ptr, bt_row_ptr, kv_off, end,
                                stride_kb, stride_ks, BLOCK_SIZE, HEAD_DIM, BLOCK_N, True, PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


@dataclass(frozen=True)
class _Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _config(dtype: torch.dtype) -> _Config:
    """Fixed per dtype (never derived from the batch: batch invariance rests on it)."""
    if dtype == torch.float32:  # tests only: ieee fp32 dots run on FMA units, keep the tiles small
        return _Config(block_m=32, block_n=32, num_warps=4, num_stages=1)
    return _Config(block_m=64, block_n=64, num_warps=4, num_stages=2)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, max_seqlen_q: int, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries to its whole paged context.

    q [total_q, Hq, D], packed by cu_seqlens_q [B+1] int32; k_cache/v_cache [blocks, block_size, Hkv, D] already
    holding the new tokens; block_tables [B, max_blocks] int32; seqlens_k [B] int32 (cached prefix + new);
    max_seqlen_q (host int) only sizes the grid. Returns [total_q, Hq, D] in q's dtype.
    """
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of 2 >= 16"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "k/v caches must share a dense layout"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(total_q, num_heads, head_dim, dtype=q.dtype, device=q.device)
    batch = seqlens_k.numel()
    if total_q == 0 or batch == 0:
        return out
    cfg = _config(q.dtype)
    grid = (triton.cdiv(max_seqlen_q, cfg.block_m), batch, num_heads)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seqlens_k, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
