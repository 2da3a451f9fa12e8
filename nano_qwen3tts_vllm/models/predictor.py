from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.attention import DenseAttention
from ..layers.triton_linear import Linear, linear
from .embeddings import CodecEmbedding
from .qwen3 import Qwen3Decoder


class CodePredictor(nn.Module):
    """The 5-layer code predictor: [talker hidden, E_0(c0)] -> c1, then E_k(c_k) -> c_{k+1}."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        g = cfg.num_code_groups
        self.codec = CodecEmbedding(cfg)
        if cfg.predictor.hidden_size != cfg.talker.hidden_size:
            self.small_to_mtp_projection = Linear(cfg.talker.hidden_size, cfg.predictor.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()
        self.model = Qwen3Decoder(cfg.predictor, DenseAttention, g + 1)
        self.lm_heads = nn.Parameter(torch.zeros(g - 1, cfg.predictor_vocab_size, cfg.predictor.hidden_size))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return self.model(self.small_to_mtp_projection(embeds), positions, meta)

    def logits(self, hidden: torch.Tensor, step: int) -> torch.Tensor:
        return linear(hidden, self.lm_heads[step])
