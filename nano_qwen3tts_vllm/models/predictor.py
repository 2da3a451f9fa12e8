from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.attention import DenseAttention
from ..layers.triton_linear import Linear, embedding_linear
from .embeddings import CodecEmbedding
from .qwen3 import Qwen3Decoder, norm_linear


class CodePredictor(nn.Module):
    """The 5-layer code predictor: [talker hidden, E_0(c0)] -> c1, then E_k(c_k) -> c_{k+1}.

    Its steps return the last layer's (output, residual) before the final norm: `logits` applies the norm in
    the lm head's kernel."""

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

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [..., talker hidden] -> (h, residual) [..., predictor hidden]."""
        return self.model.layers_forward(self.small_to_mtp_projection(embeds), positions, meta)

    def forward_codes(self, group: int, ids: torch.Tensor, positions: torch.Tensor,
                      meta) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B] of codebook `group` -> (h, residual) [B, 1, predictor hidden] of their step; with a projection
        the embedding rows are gathered inside its kernel."""
        proj, codec = self.small_to_mtp_projection, self.codec
        if isinstance(proj, Linear):
            x = embedding_linear(ids, codec.row_offsets[group], codec.weight, proj.weight, proj.bias)
        else:
            x = codec.lookup(group, ids)
        return self.model.layers_forward(x[:, None], positions, meta)

    def logits(self, h: torch.Tensor, residual: torch.Tensor, step: int) -> torch.Tensor:
        """A step's (h, residual) -> the logits of codebook step + 1 (final norm and lm head in one kernel)."""
        return norm_linear(h, residual, self.model.norm, self.lm_heads[step])[0]
