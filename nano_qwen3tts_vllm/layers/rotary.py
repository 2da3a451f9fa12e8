import torch
from torch import nn

from .fused import rope


class RotaryEmbedding(nn.Module):
    """Plain 1-D RoPE with a precomputed cos/sin table.

    The talker's config carries an interleaved M-RoPE section, but its three position
    streams are always equal, which makes it exactly this.
    """

    def __init__(self, head_dim: int, theta: float, max_position: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q, k: [..., tokens, heads, head_dim]; positions: [..., tokens]."""
        return rope(q, k, self.cos[positions].to(q.dtype), self.sin[positions].to(q.dtype))
