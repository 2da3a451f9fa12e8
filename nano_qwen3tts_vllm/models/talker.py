from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.attention import PagedAttention
from ..layers.triton_linear import Linear
from .embeddings import CodecEmbedding, TextProjection
from .qwen3 import Qwen3Decoder


class Talker(nn.Module):
    """The talker: embeddings in, final-norm hidden states out; codec_head gives codebook-0 logits."""

    def __init__(self, cfg: ModelConfig, max_position: int):
        super().__init__()
        self.cfg = cfg
        self.text = TextProjection(cfg.text_vocab_size, cfg.text_hidden_size, cfg.talker.hidden_size)
        self.codec = CodecEmbedding(cfg)
        self.model = Qwen3Decoder(cfg.talker, PagedAttention, max_position)
        self.codec_head = Linear(cfg.talker.hidden_size, cfg.codec_vocab_size, bias=False)

    def embed(self, text_ids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """One input position per row: P(text_id) (if >= 0) + the sum of its codec embeddings."""
        text = self.text(text_ids.clamp(min=0)) * (text_ids >= 0).unsqueeze(-1)
        return text + self.codec.frame_sum(codes)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return self.model(embeds, positions, meta)
