"""Qwen3 decoder layers shared by the talker and the code predictor.

Projections are merged (qkv, gate_up) for fewer, larger matmuls; the loader splits the
checkpoint's separate q/k/v and gate/up weights into them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DecoderConfig
from ..layers.fused import add_rms_norm, silu_and_mul
from ..layers.layernorm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..layers.triton_linear import Linear, norm_gemv, uses_gemv


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, attn: nn.Module, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.attn = attn
        object.__setattr__(self, "rotary", rotary)  # shared table, not a submodule of every layer

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta) -> torch.Tensor:
        """qkv: qkv_proj's output (the layer computes it, fused with its norm) -> o_proj's output."""
        lead = qkv.shape[:-1]
        if self.attn.fuses(meta):  # one Triton kernel from here to o_proj (CUDA decode)
            o = self.attn.fused_decode(qkv, positions, self.q_norm, self.k_norm, self.rotary, meta)
            return self.o_proj(o.view(*lead, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(*lead, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(*lead, self.num_kv_heads, self.head_dim))
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(*lead, self.q_size))


class Qwen3MLP(nn.Module):
    """SwiGLU weights; Qwen3DecoderLayer applies them (the gate/up projection fused with its norm)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, weight: torch.Tensor,
                silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, or x) -> (its RMSNorm through a bias-free projection, SiLU(gate) * up with silu_mul; the
    new residual). A CUDA step of one or two rows does it all in one kernel (layers/triton_linear)."""
    if uses_gemv(x, weight):
        return norm_gemv(x, residual, norm.weight, norm.eps, weight, silu_mul)
    if residual is None:
        residual, x = x, norm(x)
    else:
        residual, x = add_rms_norm(x, residual, norm.weight, norm.eps)
    y = F.linear(x, weight)
    return (silu_and_mul(y) if silu_mul else y), residual


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, attn: nn.Module, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, attn, rotary)
        self.mlp = Qwen3MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) -> (this layer's MLP output, the residual stream before it): the sum is
        deferred to the next layer's fused add + RMSNorm, one kernel fewer per layer."""
        qkv, residual = norm_linear(h, residual, self.input_layernorm, self.self_attn.qkv_proj.weight)
        attn = self.self_attn(positions, qkv, meta)
        act, residual = norm_linear(attn, residual, self.post_attention_layernorm, self.mlp.gate_up_proj.weight,
                                    silu_mul=True)
        return self.mlp.down_proj(act), residual


class Qwen3Decoder(nn.Module):
    """Layers + final norm over input embeddings."""

    def __init__(self, cfg: DecoderConfig, make_attn, max_position: int):
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_position)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, make_attn(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), self.rotary)
            for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return add_rms_norm(*self.layers_forward(embeds, positions, meta), self.norm.weight, self.norm.eps)[1]

    def layers_forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers alone -> (last MLP output, residual before it): `self.norm` of their sum is the output."""
        h, residual = embeds, None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, meta)
        return h, residual
