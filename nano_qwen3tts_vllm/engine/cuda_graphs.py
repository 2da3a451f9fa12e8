"""Per-batch-size CUDA graphs of a step function whose inputs are a dict of per-row tensors.

Batches run in the smallest captured size that holds them. Spare rows of index inputs (slots,
positions, block tables) get padding rows that point every write at scratch memory (scratch KV
block, scratch sampler slot); spare rows of data inputs keep whatever they held, which only ever
reaches scratch outputs."""
from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def batch_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 16))
    return sizes + [max_bs]


class GraphPool:
    def __init__(self, fn: Callable[[dict], tuple], rows: dict[str, torch.Tensor],
                 padding: dict[str, torch.Tensor], max_bs: int):
        """rows: one example row per input (its per-row shape, dtype and device); padding: the padding
        row of each index input (on the host)."""
        self.fn = fn
        self.padding = padding
        self.static = {k: (padding[k].to(v.device) if k in padding else v).expand(max_bs, *v.shape).clone()
                       for k, v in rows.items()}
        self.sizes = batch_sizes(max_bs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        pool = None
        for bs in reversed(self.sizes):
            inp = {k: v[:bs] for k, v in self.static.items()}
            fn(inp)  # warm-up: lazy init, autotuning, allocator
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool):
                out = fn(inp)
            pool = g.pool() if pool is None else pool
            self.graphs[bs] = (g, out)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch sizes %s); %.2f GiB allocated", len(self.sizes), self.sizes,
                    torch.cuda.memory_allocated() / 2**30)

    def bucket(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def load(self, inputs: dict[str, torch.Tensor]) -> None:
        """Copy some or all inputs of a batch into the graphs' static buffers (each may be narrower
        than the buffer in its trailing dims: block tables are only as wide as the batch needs)."""
        for k, v in inputs.items():
            B = v.shape[0]
            bs = self.bucket(B)
            if k in self.padding and bs > B:
                pad = self.padding[k][tuple(slice(0, n) for n in v.shape[1:])].to(v.device)
                v = torch.cat([v, pad.expand(bs - B, *v.shape[1:])])
            self.static[k][(slice(0, v.shape[0]),) + tuple(slice(0, n) for n in v.shape[1:])].copy_(v)

    def replay(self, batch: int) -> tuple:
        g, out = self.graphs[self.bucket(batch)]
        g.replay()
        return tuple(o[:batch] for o in out)

    def run(self, inputs: dict[str, torch.Tensor]) -> tuple:
        self.load(inputs)
        return self.replay(next(iter(inputs.values())).shape[0])

