"""Programmatic dependent launch (PDL, Hopper and later) for the decode kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running. Each of ours
first calls `gdc_launch_dependents` (the next kernel may launch as soon as all our programs have started), then
reads only what no earlier kernel writes (the weights) and waits in `gdc_wait` for the previous kernel to
finish before it reads or writes anything else. In a CUDA graph of one-row steps this hides the launch gap and
the ramp of each small kernel: 300 chained predictor GEMVs on an H100 took 1593 us without PDL, 1082 us with it.

NANO_QWEN3TTS_PDL=0 turns it off.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("NANO_QWEN3TTS_PDL", "1") != "0"


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL: CUDA on sm90+ and not turned off."""
    return ENABLED and t.is_cuda and _supported(t.device.index if t.device.index is not None
                                                else torch.cuda.current_device())


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Blocks until the previous kernel has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
