"""Per-batch-size CUDA graphs of a step function whose inputs are a dict of per-row tensors.

Batches run in the smallest captured size that holds them. Spare rows of index inputs (slots,
positions, block tables) get padding rows that point every write at scratch memory (scratch KV
block, scratch sampler slot); spare rows of data inputs keep whatever they held, which only ever
reaches scratch outputs."""
from __future__ import annotations

import logging
from typing import Callable, Iterable

import numpy as np
import torch

logger = logging.getLogger(__name__)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without blocking the host: staged in pinned memory (a pageable copy waits
    for all earlier work on the stream). The caching host allocator behind pin_memory() records an event on
    the copy's stream and does not reuse the block before it has run, so the staging tensor may die at once."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def capture_graphs(keys: Iterable, run: Callable[[object], tuple]) -> dict:
    """key -> (graph, outputs of run(key)), captured in the order given (largest first: later ones reuse
    its memory) into one pool. In inference mode: with autograd on, a capture keeps every activation alive."""
    graphs, pool = {}, None
    with torch.inference_mode():
        for key in keys:
            run(key)  # warm-up: kernel compilation, lazy init, allocator
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool):
                out = run(key)
            pool = g.pool() if pool is None else pool
            graphs[key] = (g, out)
        torch.cuda.synchronize()
    return graphs


def batch_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 16))
    return sizes + [max_bs]


class GraphPool:
    def __init__(self, fn: Callable[[dict], tuple], rows: dict[str, torch.Tensor],
                 padding: dict[str, torch.Tensor], max_bs: int):
        """rows: one example row per input (its per-row shape, dtype and device); padding: the padding
        row of each index input (on the host)."""
        self.padding = padding
        self.static = {k: (padding[k].to(v.device) if k in padding else v).expand(max_bs, *v.shape).clone()
                       for k, v in rows.items()}
        self.sizes = batch_sizes(max_bs)
        self.graphs = capture_graphs(reversed(self.sizes), lambda bs: fn({k: v[:bs] for k, v in self.static.items()}))
        logger.info("captured %d CUDA graphs (batch sizes %s); %.2f GiB allocated", len(self.sizes), self.sizes,
                    torch.cuda.memory_allocated() / 2**30)

    def bucket(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def load(self, inputs: dict[str, torch.Tensor]) -> None:
        """Copy some or all inputs of a batch into the graphs' static buffers (each may be narrower
        than the buffer in its trailing dims: block tables are only as wide as the batch needs), without
        blocking the host."""
        for k, v in inputs.items():
            B = v.shape[0]
            bs = self.bucket(B)
            if k in self.padding and bs > B:
                pad = self.padding[k][tuple(slice(0, n) for n in v.shape[1:])].to(v.device)
                v = torch.cat([v, pad.expand(bs - B, *v.shape[1:])])
            if v.device.type == "cpu":
                v = v.pin_memory()  # see to_device
            self.static[k][(slice(0, v.shape[0]),) + tuple(slice(0, n) for n in v.shape[1:])].copy_(
                v, non_blocking=True)

    def replay(self, batch: int) -> tuple:
        g, out = self.graphs[self.bucket(batch)]
        g.replay()
        return tuple(o[:batch] for o in out)

    def run(self, inputs: dict[str, torch.Tensor]) -> tuple:
        self.load(inputs)
        return self.replay(next(iter(inputs.values())).shape[0])


class PrefillGraphs:
    """CUDA graphs of a prefill per token bucket. Per-token inputs are padded to the bucket, per-sequence inputs
    to the maximum number of sequences (the caller pads: see TalkerRunner._prefill_arrays)."""

    def __init__(self, fn: Callable[[dict, int], tuple], example: dict[str, np.ndarray], token_inputs: tuple[str, ...],
                 buckets: tuple[int, ...], device: torch.device):
        """example: padded inputs for the largest bucket; fn(inputs, tokens) -> outputs."""
        self.buckets, self.max_tokens, self.token_inputs = buckets, buckets[-1], token_inputs
        self.static = {k: torch.from_numpy(v).to(device) for k, v in example.items()}
        self.graphs = capture_graphs(reversed(buckets), lambda T: fn(self._inputs(T), T))
        logger.info("captured %d prefill CUDA graphs (tokens %s); %.2f GiB allocated", len(buckets), list(buckets),
                    torch.cuda.memory_allocated() / 2**30)

    def _inputs(self, tokens: int) -> dict[str, torch.Tensor]:
        return {k: v[:tokens] if k in self.token_inputs else v for k, v in self.static.items()}

    def bucket(self, tokens: int) -> int:
        return next(b for b in self.buckets if b >= tokens)

    def run(self, tokens: int, arrays: dict[str, np.ndarray]) -> tuple:
        """arrays: padded to `tokens` (a bucket) rows and to the maximum number of sequences."""
        for k, v in self._inputs(tokens).items():
            v.copy_(torch.from_numpy(arrays[k]))
        g, out = self.graphs[tokens]
        g.replay()
        return out
