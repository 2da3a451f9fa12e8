"""The whole sampler of engine/sampler.py (`_sample`) as one Triton kernel: one program per row holds the row's
logits in registers (BLOCK = next power of two >= V) and sorts nothing.

Greedy rows: the argmax of the logits (first index on ties, as torch.argmax). Sampled rows:
  1. x = logits / temperature (IEEE division, as torch).
  2. top-k (0 < top_k < V): the k-th largest x by bisection on an int32 key ordered as the float32 values, each
     step counting the tokens at or above the midpoint; tokens with x >= it are kept (ties at it kept).
  3. top-p (top_p < 1), transformers' TopPLogitsWarper without the sort: with q the softmax of the top-k
     survivors, a bisection on the key finds the smallest value T whose mass S(T) = sum(q[x <= T]) exceeds
     1 - top_p (or the largest value). Tokens below T are removed, tokens above it kept; the tokens tied at T are
     taken in index order, as a stable ascending sort places them (torch's radix sort on CUDA), and the r-th
     (1-based) is removed iff S(< T) + r * q(T) <= 1 - top_p. The last token of that order (the highest index
     holding the maximum) is never removed.
  4. The exponential race: argmax over the kept tokens of p_i / -log(u_i), p the softmax of the kept x, u the
     counter-based noise of engine/sampler.py `_noise` (lowbias32 in uint32 arithmetic), so a seeded request
     draws the same token on either path.

Each bisection step is one block reduction over the row, at most ~32 steps for top-k and for top-p: O(V) a step.
The decisions are `_sample`'s up to float rounding (sums in another order; expf is CUDA's as in torch, numpy's in
the interpreter): a token can differ only where a cumulative mass lies within ~1e-6 of 1 - top_p, or where the two
best race scores agree to float rounding. Tokens tied at the top-p boundary follow the stable order; the CPU path's
sort leaves their order unspecified (it keeps as many of them, maybe others). Logits of any float dtype are read
as float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .pdl import launch_dependents, use_pdl, wait_prior


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (wrapping multiplies, logical shifts), as engine/sampler.py `_mix32`."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _order_key(x):
    """int32 whose signed order is the order of the float32 x (-0.0 and 0.0 share a key)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(key == -1, 0, key)


@triton.jit
def _sample_kernel(logits_ptr, stride_row, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr,
                   counters_ptr, stride_counter, counter_offset, out_ptr, V, BLOCK: tl.constexpr,
                   LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    launch_dependents(PDL)  # the next kernel streams its weights meanwhile
    wait_prior(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < V
    logits = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=valid,
                     other=float("-inf")).to(tl.float32)
    if tl.load(do_sample_ptr + row) != 0:
        x = tl.div_rn(logits, tl.load(temperature_ptr + row))
        key = tl.where(valid, _order_key(x), -2147483648)  # padding below every value, -inf included
        key_max = tl.max(key, axis=0).to(tl.int64)
        key_min = tl.min(tl.where(valid, key, 2147483647), axis=0).to(tl.int64)

        # top-k: the largest key K with #{key >= K} >= k
        k = tl.load(top_k_ptr + row)
        kth = key_min
        if (k > 0) & (k < V):
            lo = key_min
            hi = key_max
            while lo < hi:
                mid = lo + ((hi - lo + 1) >> 1)
                ok = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0) >= k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
            kth = lo
        kept = key >= kth.to(tl.int32)
        y = x - tl.max(x, axis=0)
        if LIBDEVICE:  # expf as torch's softmax, not tl.exp's ex2.approx (the interpreter has no libdevice)
            y = libdevice.exp(y)
        else:
            y = tl.exp(y)
        e = tl.where(kept, y, 0.0)

        # top-p: the smallest key T with S(T) > 1 - top_p (else the largest), then the ties at T in index order
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            thr = 1.0 - top_p
            q = tl.div_rn(e, tl.sum(e, axis=0))
            lo = kth
            hi = key_max
            while lo < hi:
                mid = lo + ((hi - lo) >> 1)
                ok = tl.sum(tl.where(key <= mid.to(tl.int32), q, 0.0), axis=0) > thr
                lo = tl.where(ok, lo, mid + 1)
                hi = tl.where(ok, mid, hi)
            t = lo.to(tl.int32)
            tied = key == t
            q_t = tl.max(tl.where(tied, q, 0.0), axis=0)
            below = tl.sum(tl.where(key < t, q, 0.0), axis=0)
            rank = tl.cumsum(tied.to(tl.int32), axis=0)  # 1-based position among the tied tokens
            n_tied = tl.sum(tied.to(tl.int32), axis=0)
            removed = tied & (below + rank.to(tl.float32) * q_t <= thr) & ((lo < key_max) | (rank < n_tied))
            kept = kept & (key >= t) & ~removed
            e = tl.where(kept, e, 0.0)

        # the race: argmax p_i / E_i, E_i = -log(u_i) with u from the counter-based hash of `_noise`
        prob = tl.div_rn(e, tl.sum(e, axis=0))
        seed = tl.load(seeds_ptr + row)
        counter = tl.load(counters_ptr + row * stride_counter) + counter_offset
        h = _mix32(counter.to(tl.uint32))
        h = _mix32(seed.to(tl.uint32) ^ _mix32((seed >> 32).to(tl.uint32) ^ h))
        bits = _mix32(h ^ _mix32(cols.to(tl.uint32) + 0x9E3779B9))
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        score = tl.where(kept, tl.div_rn(prob, -tl.log(u)), -1.0)
        token = tl.argmax(score, axis=0)
    else:
        token = tl.argmax(logits, axis=0)  # first index of the maximum, as torch.argmax
    tl.store(out_ptr + row, token.to(tl.int64))


_INTERPRETED = not isinstance(_sample_kernel, triton.runtime.JITFunction)  # TRITON_INTERPRET=1


def triton_sample(logits: torch.Tensor, do_sample: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor | int,
                  counter_offset: int = 0) -> torch.Tensor:
    """logits [B, V] -> token ids [B] int64. Per-row settings [B]; counters [B], or one value for every row
    (a 0-d/1-element tensor or an int), plus counter_offset. No host synchronisation: CUDA-graph capturable."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if not isinstance(counters, torch.Tensor):
        counters = torch.full((), counters, dtype=torch.long, device=logits.device)
    stride_counter = counters.stride(0) if counters.numel() > 1 else 0
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    if B == 0:
        return out
    block = triton.next_power_of_2(V)
    pdl = use_pdl(logits)
    # 8 warps: one row of 2048 codes (top-k 50) 13.1 us on an H100, 15.1 us in 4 warps, 22.8 in 2
    _sample_kernel[(B,)](
        logits, logits.stride(0), do_sample.contiguous(), temperature.float().contiguous(),
        top_k.long().contiguous(), top_p.float().contiguous(), seeds.long().contiguous(), counters.long(),
        stride_counter, counter_offset, out, V, BLOCK=block, LIBDEVICE=not _INTERPRETED, PDL=pdl, num_warps=8,
        launch_pdl=pdl)
    return out
