import torch
from torch import nn

from .fused import rms_norm


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, cast back, then scale (same op order as upstream)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
