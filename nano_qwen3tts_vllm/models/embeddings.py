"""Input embeddings of the talker: projected text, and the 16 codec embeddings in one table."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..layers.triton_linear import Linear


class TextProjection(nn.Module):
    """text_embedding -> Linear+bias, SiLU, Linear+bias -> talker hidden."""

    def __init__(self, text_vocab: int, text_hidden: int, hidden: int):
        super().__init__()
        self.text_embedding = nn.Embedding(text_vocab, text_hidden)
        self.linear_fc1 = Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = Linear(text_hidden, hidden, bias=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(self.text_embedding(ids))))


class CodecEmbedding(nn.Module):
    """E_0 (the talker's codec embedding, 3072 rows) and E_1..E_15 (the predictor's, 2048 rows
    each) stacked in one table, plus a zero row that code -1 ("no code here") maps to.

    One gather gives all 16 embeddings of a frame; their sum is the talker's next input.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        g, v0, v = cfg.num_code_groups, cfg.codec_vocab_size, cfg.predictor_vocab_size
        offsets = [0] + [v0 + i * v for i in range(g - 1)]
        self.num_rows = v0 + (g - 1) * v
        self.weight = nn.Parameter(torch.zeros(self.num_rows + 1, cfg.talker.hidden_size))
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.long), persistent=False)
        self.row_offsets = offsets

    def lookup(self, group: int, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids + self.row_offsets[group], self.weight)

    def frame_sum(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [N, 16] (-1 = absent) -> sum of the present embeddings, [N, hidden]."""
        idx = torch.where(codes >= 0, codes + self.offsets, self.num_rows)
        return F.embedding(idx, self.weight).sum(1)
