"""Vectorised sampling with per-row settings, following the transformers processors qwen-tts uses.

Order (as upstream): repetition penalty on the codebook-0 history, min_new_tokens (EOS masked),
suppressed ids; then, for sampled rows, temperature, top-k, top-p; greedy rows take the argmax
of the processed logits.

Randomness is counter-based: the noise for (seed, counter) is a hash of those two numbers and
the vocabulary index, so a seeded request draws the same numbers whether it runs alone or in any
batch, on any device, and the whole sampler can live inside a CUDA graph.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ..layers.fused import cuda_compiled

# On CUDA the whole sampler is one Triton kernel; NANO_QWEN3TTS_TRITON_SAMPLER=0 keeps the torch path there too.
TRITON_SAMPLER = os.environ.get("NANO_QWEN3TTS_TRITON_SAMPLER", "1") != "0"

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x < 2**32, without int64 overflow (split c into 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=8)
def _column_hash(vocab: int, device: str) -> torch.Tensor:
    # computed eagerly once: inside torch.compile an int32 arange would meet 32-bit constants
    cols = torch.arange(vocab, device=device, dtype=torch.long)
    return _mix32((cols + 0x9E3779B9) & _M32)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 in (0, 1), a pure function of (seed, counter, column)."""
    return _noise(seeds, counters, _column_hash(vocab, str(seeds.device)))


def _noise(seeds: torch.Tensor, counters: torch.Tensor, col_hash: torch.Tensor) -> torch.Tensor:
    s = seeds.long()
    key = _mix32((s & _M32) ^ _mix32(((s >> 32) & _M32) ^ _mix32(counters.long() & _M32)))
    bits = _mix32(key[:, None] ^ col_hash[None, :])
    # 23 bits + 0.5 is exact in float32, so u is strictly inside (0, 1) and -log(u) > 0
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    """Per-row settings of one sampler call, on the device of the logits."""
    do_sample: torch.Tensor     # [B] bool
    temperature: torch.Tensor   # [B] float32
    top_k: torch.Tensor         # [B] int64, 0 = off
    top_p: torch.Tensor         # [B] float32, 1 = off
    seeds: torch.Tensor         # [B] int64


class SlotSettings:
    """Sampling settings per sequence slot, on the device. Written once when a sequence is admitted,
    so a decode step sends only slot numbers and the step (a CUDA graph) gathers its rows itself.
    Row `num_slots` is scratch: the greedy padding row of graph batches."""

    def __init__(self, num_slots: int, device, extra: dict[str, tuple[torch.dtype, float]] | None = None):
        self.fields = dict(do_sample=(torch.bool, False), temperature=(torch.float32, 1.0),
                           top_k=(torch.long, 0), top_p=(torch.float32, 1.0), seeds=(torch.long, 0), **(extra or {}))
        self.values = {k: torch.full((num_slots + 1,), v, dtype=dt, device=device)
                       for k, (dt, v) in self.fields.items()}

    def set(self, slots: list[int], rows: list[dict]) -> None:
        """rows: one dict per slot with a value for every field."""
        idx = torch.tensor(slots, dtype=torch.long)
        for k, (dt, _) in self.fields.items():
            t = self.values[k]
            t[idx.to(t.device)] = torch.tensor([r[k] for r in rows], dtype=dt).to(t.device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.values[name]

    def gather(self, slots: torch.Tensor) -> SamplingTensors:
        v = self.values
        return SamplingTensors(v["do_sample"][slots], v["temperature"][slots], v["top_k"][slots],
                               v["top_p"][slots], v["seeds"][slots])


@cuda_compiled
def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor,
                    block_eos: torch.Tensor, eos_id: int, suppress: torch.Tensor) -> torch.Tensor:
    """Talker-only processors. logits [B, V] fp32; seen [B, V] bool (generated before);
    penalty [B]; block_eos [B] bool (min_new_tokens not reached); suppress [V] bool."""
    p = penalty[:, None]
    logits = torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)
    # built on the device (graph-capturable); an eos_id outside the vocab (fixed-length checkpoints) masks nothing
    eos_mask = torch.arange(logits.shape[-1], device=logits.device) == eos_id
    logits = logits.masked_fill(block_eos[:, None] & eos_mask[None, :], float("-inf"))
    return logits.masked_fill(suppress[None, :], float("-inf"))


def warp(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k (ties at the k-th value kept), then top-p (as transformers)."""
    return _warp(logits, st.temperature, st.top_k, st.top_p)


def _warp(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    V = logits.shape[-1]
    logits = logits / temperature[:, None]
    sorted_logits, sorted_idx = logits.sort(dim=-1)                          # ascending
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    kth = sorted_logits.gather(1, (V - k)[:, None])
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - top_p)[:, None]
    remove[:, -1] = False
    remove = remove.scatter(1, sorted_idx, remove)
    return logits.masked_fill(remove, float("-inf"))


def sample(logits: torch.Tensor, st: SamplingTensors, counters: torch.Tensor | int, counter_offset: int = 0
           ) -> torch.Tensor:
    """logits [B, V] after penalties (any float dtype, read as fp32) -> token ids [B] (int64). The noise counter of
    row i is counters[i] (or one value for all rows) + counter_offset. CUDA tensors take the one-kernel Triton
    sampler (layers/triton_sampler.py), which draws the same tokens up to float rounding; CPU tensors the torch
    path."""
    kernel = _triton_sample() if logits.is_cuda and TRITON_SAMPLER else None
    if kernel is not None:
        return kernel(logits, st.do_sample, st.temperature, st.top_k, st.top_p, st.seeds, counters, counter_offset)
    if not isinstance(counters, torch.Tensor):
        counters = torch.tensor(counters, device=logits.device)
    col_hash = _column_hash(logits.shape[-1], str(logits.device))
    return _sample(logits.float(), st.do_sample, st.temperature, st.top_k, st.top_p, st.seeds,
                   counters + counter_offset, col_hash)


@functools.cache
def _triton_sample():
    """layers.triton_sampler.triton_sample, or None without triton (imported on first use)."""
    try:
        from ..layers.triton_sampler import triton_sample
    except ImportError:
        return None
    return triton_sample


@cuda_compiled
def _sample(logits, do_sample, temperature, top_k, top_p, seeds, counters, col_hash) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)
    probs = _warp(logits, temperature, top_k, top_p).softmax(dim=-1)
    exp_noise = -torch.log(_noise(seeds, counters, col_hash))
    sampled = (probs / exp_noise).argmax(dim=-1)   # exponential race == categorical draw
    return torch.where(do_sample, sampled, greedy)
