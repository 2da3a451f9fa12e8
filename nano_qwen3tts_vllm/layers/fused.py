"""Small pure functions that torch.compile fuses into one kernel each on CUDA (as nano-vLLM does).

CUDA graphs remove launch overhead but not the launches themselves: unfused, one predictor frame
is thousands of tiny kernels. CPU tensors take the plain eager path (CI, fp32 parity), and
NANO_QWEN3TTS_COMPILE=0 turns compilation off everywhere."""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

ENABLED = os.environ.get("NANO_QWEN3TTS_COMPILE", "1") != "0"
# Each function sees a few tensor ranks x dtypes (talker, predictor, q/k norms; bf16 and fp32 models):
# a bounded set of specialisations, more than dynamo's default of 8.
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, 64)


def cuda_compiled(fn):
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if ENABLED and args[0].is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True, fullgraph=True)
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper


@cuda_compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back, then scale: the op order of upstream's Qwen3 RMSNorm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@cuda_compiled
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, rms_norm(residual + x))."""
    h = residual + x
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return h, weight * hf.to(h.dtype)


@cuda_compiled
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., heads, D]; cos, sin [..., D] (already in q's dtype)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    q1, q2 = q.chunk(2, dim=-1)
    k1, k2 = k.chunk(2, dim=-1)
    return q * cos + torch.cat((-q2, q1), -1) * sin, k * cos + torch.cat((-k2, k1), -1) * sin


@cuda_compiled
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
