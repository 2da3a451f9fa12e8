"""One-token decode attention in Triton, fused with everything between the qkv projection and o_proj:
q/k RMSNorm, RoPE, the cache write and attention over the sequence's blocks (online softmax).

One program per (sequence, kv head) handles the query heads of its group. Unfused this is ~8 kernels
per layer (norms, cos/sin gather, rope, two cache writes, attention, a copy); a decode step of the
code predictor is 15 x 5 layers of it, so the launches, not the bytes, set its speed.

The cache is paged: [blocks, block_size, kv_heads, head_dim] with a block table per sequence. The
predictor's dense cache [rows, positions, kv_heads, head_dim] is the same thing with one block per row.
Rounding follows the unfused bf16 ops (norm in fp32, cast, scale; rope terms rounded one by one).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_dependents, use_pdl, wait_prior


@triton.jit
def _round(x, dtype: tl.constexpr):
    return x.to(dtype).to(tl.float32)


@triton.jit
def _norm_rope(raw, raw_rot, w, w_rot, sign, cos, sin, eps, D: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm then RoPE of rows raw [R, D]; raw_rot/w_rot are them and the weight read at (d + D/2) % D."""
    rs = tl.rsqrt(tl.sum(raw * raw, axis=1) / D + eps)[:, None]
    x = _round(w * _round(raw * rs, dtype), dtype)
    x_rot = sign * _round(w_rot * _round(raw_rot * rs, dtype), dtype)
    return _round(_round(x * cos, dtype) + _round(x_rot * sin, dtype), dtype)


@triton.jit
def _fused_decode_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, bt_ptr, k_ptr, v_ptr, out_ptr,
                         part_ptr, eps, scale, stride_qkv, stride_pos, stride_cos, stride_bt, stride_kb, stride_ks,
                         stride_kh, stride_out, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                         GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)  # the next kernel (o_proj) streams its weights meanwhile
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    D: tl.constexpr = HEAD_DIM
    dtype = out_ptr.dtype.element_ty
    d = tl.arange(0, D)
    d_rot = (d + D // 2) % D
    sign = tl.where(d < D // 2, -1.0, 1.0)
    g = tl.arange(0, GROUP_PAD)
    g_mask = g < GROUP
    qw = tl.load(qw_ptr + d).to(tl.float32)
    qw_rot = tl.load(qw_ptr + d_rot).to(tl.float32)
    kw = tl.load(kw_ptr + d).to(tl.float32)
    kw_rot = tl.load(kw_ptr + d_rot).to(tl.float32)
    wait_prior(PDL)
    pos = tl.load(pos_ptr + b * stride_pos)
    cos = tl.load(cos_ptr + pos * stride_cos + d).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + d).to(tl.float32)

    row = qkv_ptr + b * stride_qkv
    q_off = (kvh * GROUP + g)[:, None] * D
    q = tl.load(row + q_off + d[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
    q_rot = tl.load(row + q_off + d_rot[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
    q = _norm_rope(q, q_rot, qw, qw_rot, sign, cos, sin, eps, D, dtype)
    k_off = NUM_HEADS * D + kvh * D
    dk = d[None, :]  # the new k/v as [1, D] rows
    k = tl.load(row + k_off + dk).to(tl.float32)
    k_rot = tl.load(row + k_off + d_rot[None, :]).to(tl.float32)
    k = _norm_rope(k, k_rot, kw, kw_rot, sign, cos, sin, eps, D, dtype)
    v = tl.load(row + k_off + NUM_KV_HEADS * D + dk)

    if split == 0:
        block = tl.load(bt_ptr + b * stride_bt + pos // BLOCK_SIZE).to(tl.int64)
        cache_off = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kvh * stride_kh + dk
        tl.store(k_ptr + cache_off, k.to(dtype))
        tl.store(v_ptr + cache_off, v)

    # this split's share of the cached context [0, pos) from memory; split 0 adds the new token from registers
    # (no read-after-write)
    chunk = tl.cdiv(tl.cdiv(pos, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(pos, lo + chunk)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        blk = tl.load(bt_ptr + b * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = blk * stride_kb + (n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        kc = tl.load(k_ptr + off[:, None] + d[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        vc = tl.load(v_ptr + off[:, None] + d[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * kc[None, :, :], axis=2) * scale      # [G, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vc[None, :, :], axis=1)
        m = m_new
    if split == 0:
        s = tl.sum(q * k, axis=1) * scale                                # [G]
        m_new = tl.maximum(m, s)
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        l = l * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
        m = m_new
    heads = kvh * GROUP + g
    if SPLITS == 1:
        out = acc / l[:, None]
        tl.store(out_ptr + b * stride_out + heads[:, None] * D + d[None, :], out.to(dtype), mask=g_mask[:, None])
    else:  # partial [B, Hq, SPLITS, D + 2]: the unnormalised sum, then m and l; _combine_kernel merges them
        part = part_ptr + ((b * NUM_HEADS + heads) * SPLITS + split) * (D + 2)
        tl.store(part[:, None] + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part + D, m, mask=g_mask)
        tl.store(part + D + 1, l, mask=g_mask)


@triton.jit
def _combine_kernel(part_ptr, out_ptr, stride_out, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One program per (sequence, query head): the splits' partial softmax sums -> the attention output."""
    launch_dependents(PDL)
    wait_prior(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    D: tl.constexpr = HEAD_DIM
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    part = part_ptr + ((b * NUM_HEADS + h) * SPLITS + sp) * (D + 2)
    m = tl.load(part + D)
    l = tl.load(part + D + 1)
    acc = tl.load(part[:, None] + d[None, :])
    w = tl.exp(m - tl.max(m, axis=0))  # split 0 holds the new token: the maximum is finite; empty splits weigh 0
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + b * stride_out + h * D + d, out.to(out_ptr.dtype.element_ty))


def fused_decode(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, num_heads: int, scale: float, splits: int = 1) -> torch.Tensor:
    """qkv [B, (Hq + 2 Hkv) D] (one new token per sequence, before norms and RoPE); q_norm/k_norm [D];
    cos/sin [max_position, D]; positions [B] (stride 0 allowed: every row at one position); caches
    [blocks, block_size, Hkv, D]; block_tables [B, W] -> attention output [B, Hq D]. Writes the new k/v.

    splits > 1 (a power of two) shares each sequence's context among that many programs per kv head (flash
    decoding) and merges their partial sums in a second kernel: a long context is then read in parallel, not in
    a loop of dependent loads. How a sequence's context is split depends on its position alone, not the batch."""
    B = qkv.shape[0]
    _, block_size, Hkv, D = k_cache.shape
    assert qkv.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty(B, num_heads * D, dtype=qkv.dtype, device=qkv.device)
    part = torch.empty(B, num_heads, splits, D + 2, dtype=torch.float32, device=qkv.device) if splits > 1 else out
    group = num_heads // Hkv
    pdl = use_pdl(qkv)
    # one warp and 16-position tiles: at batch 1 and 64, 17 or 150 positions, the fastest on an H100
    _fused_decode_kernel[(B, Hkv, splits)](
        qkv, q_norm, k_norm, cos, sin, positions, block_tables, k_cache, v_cache, out, part, eps, scale,
        qkv.stride(0), positions.stride(0), cos.stride(0), block_tables.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), out.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=Hkv, GROUP_PAD=max(triton.next_power_of_2(group), 1), HEAD_DIM=D,
        BLOCK_SIZE=block_size, BLOCK_N=16, SPLITS=splits, PDL=pdl, num_warps=1,
        launch_pdl=pdl)
    if splits > 1:
        _combine_kernel[(B, num_heads)](part, out, out.stride(0), NUM_HEADS=num_heads, HEAD_DIM=D, SPLITS=splits,
                                        PDL=pdl, num_warps=1, launch_pdl=pdl)
    return out
