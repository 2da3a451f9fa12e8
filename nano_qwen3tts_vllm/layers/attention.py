"""Attention over the paged KV cache (talker) and over a small dense cache (code predictor).

The paged cache of one layer is [num_blocks + 1, block_size, kv_heads, head_dim]; the last
block is scratch: padded rows of a CUDA-graph batch write there and block tables are padded
with it, so no kernel ever needs a bounds check.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def decode_splits(batch: int) -> int:
    """Programs per (sequence, kv head) sharing a talker decode step's context (flash decoding), about 256 / batch
    (a power of two, 1..16). One layer at 150 positions on an H100: batch 1 20.0 us in 1 split, 6.5 in 16; batch
    64 28.5 us in 1, 22.0 in 4, 27.7 in 16; batch 256 62.1 us in 1, 98.5 in 16."""
    n = max(1, 256 // max(batch, 1))
    return min(16, 1 << (n.bit_length() - 1))


@dataclass
class PagedMetadata:
    """Per-step inputs of paged attention, built by the talker runner."""
    is_prefill: bool
    slot_mapping: torch.Tensor                 # [tokens] int64: cache slot of each new token
    context_lens: torch.Tensor | None = None   # [B] int32: tokens in cache after this step
    block_tables: torch.Tensor | None = None   # [B, max_blocks] int32
    # prefill only (host lists: the torch backend loops over sequences; Triton sizes its grid by them)
    seqlens_q: list[int] | None = None
    seqlens_k: list[int] | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    has_prefix: bool = False                   # some sequence reuses cached prefix blocks


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def _sdpa(q, k, v, mask, scale):
    """q [Hq, n, D], k/v [Hkv, s, D] (or batched with a leading dim)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3])


def torch_prefill(q, k, v, k_cache, v_cache, meta: PagedMetadata, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    start_q = 0
    for i, (n, ctx) in enumerate(zip(meta.seqlens_q, meta.seqlens_k)):
        qi = q[start_q:start_q + n]
        if ctx == n:  # nothing cached before: the new keys are the whole context
            ki, vi = k[start_q:start_q + n], v[start_q:start_q + n]
        else:
            blocks = meta.block_tables[i, :(ctx + block_size - 1) // block_size].long()
            ki = k_cache[blocks].flatten(0, 1)[:ctx]
            vi = v_cache[blocks].flatten(0, 1)[:ctx]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        o = _sdpa(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1), mask, scale)
        out[start_q:start_q + n] = o.transpose(0, 1)
        start_q += n
    return out


def torch_decode(q, k_cache, v_cache, meta: PagedMetadata, scale: float) -> torch.Tensor:
    """q [B, Hq, D]: one new token per sequence, attending to its whole paged context."""
    B = q.shape[0]
    k = k_cache[meta.block_tables.long()].flatten(1, 2)   # [B, S, Hkv, D]
    v = v_cache[meta.block_tables.long()].flatten(1, 2)
    mask = torch.arange(k.shape[1], device=q.device)[None, :] < meta.context_lens[:, None]
    o = _sdpa(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask.view(B, 1, 1, -1), scale)
    return o.squeeze(2)


def flash_prefill(q, k, v, k_cache, v_cache, meta: PagedMetadata, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func
    block_table = None
    if meta.has_prefix:  # read the whole context (cached prefix + new) from the paged cache
        k, v, block_table = k_cache, v_cache, meta.block_tables
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                                  max_seqlen_q=max(meta.seqlens_q), max_seqlen_k=max(meta.seqlens_k),
                                  softmax_scale=scale, causal=True, block_table=block_table)


def flash_decode(q, k_cache, v_cache, meta: PagedMetadata, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_with_kvcache
    return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                   block_table=meta.block_tables, softmax_scale=scale, causal=True).squeeze(1)


class PagedAttention(nn.Module):
    """Writes the new k/v into the paged cache, then attends (varlen prefill or decode)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = "torch"

    def fuses(self, meta: PagedMetadata) -> bool:
        return self.backend == "triton" and not meta.is_prefill

    def fused_decode(self, qkv, positions, q_norm, k_norm, rotary, meta: PagedMetadata) -> torch.Tensor:
        """qkv [B, ...] before norms and RoPE -> attention output [B, Hq * D] (triton_attention)."""
        from .triton_attention import fused_decode
        return fused_decode(qkv, q_norm.weight, k_norm.weight, q_norm.eps, rotary.cos, rotary.sin, positions,
                            self.k_cache, self.v_cache, meta.block_tables, self.num_heads, self.scale,
                            splits=decode_splits(qkv.shape[0]))

    def forward(self, q, k, v, meta: PagedMetadata) -> torch.Tensor:
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if self.backend == "flash":
            if meta.is_prefill:
                return flash_prefill(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
            return flash_decode(q, self.k_cache, self.v_cache, meta, self.scale)
        if meta.is_prefill and self.backend == "triton":
            from .triton_prefill import paged_prefill
            return paged_prefill(q, self.k_cache, self.v_cache, meta.block_tables, meta.cu_seqlens_q,
                                 meta.context_lens, max(meta.seqlens_q), self.scale)
        if meta.is_prefill:
            return torch_prefill(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return torch_decode(q, self.k_cache, self.v_cache, meta, self.scale)


@dataclass
class DenseMetadata:
    """The code predictor's per-frame cache: every row of the batch is at the same step."""
    start: int      # first position written by this call
    end: int        # positions [0, end) are valid after it


class DenseAttention(nn.Module):
    """Attention over a static [B, positions, kv_heads, head_dim] cache, one per layer. With `rows` set
    ([max_rows, 1] int32 arange: row b is cache block b), one-token steps run the fused Triton kernel."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache = self.v_cache = torch.tensor([])
        self.rows: torch.Tensor | None = None

    def fuses(self, meta: DenseMetadata) -> bool:
        return self.rows is not None and meta.end - meta.start == 1

    def fused_decode(self, qkv, positions, q_norm, k_norm, rotary, meta: DenseMetadata) -> torch.Tensor:
        """qkv [B, 1, ...], positions [B, 1] -> [B, Hq * D]."""
        from .triton_attention import fused_decode
        B = qkv.shape[0]
        return fused_decode(qkv.view(B, -1), q_norm.weight, k_norm.weight, q_norm.eps, rotary.cos, rotary.sin,
                            positions[:, 0], self.k_cache, self.v_cache, self.rows[:B], self.num_heads, self.scale)

    def forward(self, q, k, v, meta: DenseMetadata) -> torch.Tensor:
        """q/k/v: [B, n, heads, D] with n = end - start."""
        B = q.shape[0]
        self.k_cache[:B, meta.start:meta.end] = k
        self.v_cache[:B, meta.start:meta.end] = v
        kc = self.k_cache[:B, :meta.end].transpose(1, 2)
        vc = self.v_cache[:B, :meta.end].transpose(1, 2)
        n = meta.end - meta.start
        mask = None
        if n > 1:
            q_pos = torch.arange(meta.start, meta.end, device=q.device)
            mask = torch.arange(meta.end, device=q.device)[None, :] <= q_pos[:, None]
        o = _sdpa(q.transpose(1, 2), kc, vc, mask, self.scale)
        return o.transpose(1, 2)
