"""Per-batch-size CUDA graphs of a step function whose inputs are a dict of tensors.

Batches run in the smallest captured size that holds them; the spare rows get padding values
that point every write at scratch memory (scratch KV block, scratch sampler row)."""
from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def batch_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs] + list(range(16, max_bs, 16))
    return sizes + [max_bs]


class GraphPool:
    def __init__(self, fn: Callable[[dict], tuple], padding: dict[str, torch.Tensor], max_bs: int):
        """padding: one padding row per input (shape = the input's per-row shape)."""
        self.fn = fn
        self.padding = padding
        self.static = {k: v.expand(max_bs, *v.shape).clone() for k, v in padding.items()}
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
        logger.info("captured %d CUDA graphs (batch sizes %s)", len(self.sizes), self.sizes)

    def run(self, inputs: dict[str, torch.Tensor]) -> tuple:
        B = next(iter(inputs.values())).shape[0]
        bs = next(s for s in self.sizes if s >= B)
        for k, v in inputs.items():
            dst = self.static[k]
            if v.shape[1:] != dst.shape[1:] or B < bs:
                dst[:bs].copy_(self.padding[k].expand_as(dst[:bs]))
            dst[(slice(0, B),) + tuple(slice(0, n) for n in v.shape[1:])].copy_(v)
        g, out = self.graphs[bs]
        g.replay()
        return tuple(o[:B] for o in out)
