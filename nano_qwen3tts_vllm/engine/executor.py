"""Where the model work of a step runs. The in-process executor calls the two runners directly;
`workers.executor.MultiprocessExecutor` does the same through a talker and a predictor process."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..config import EngineConfig, ModelConfig
from .predictor_runner import PredictorRunner
from .sequence import DecodeBatch, PrefillRow
from .talker_runner import TalkerRunner


def prefill_and_sample(talker: TalkerRunner, rows: list[PrefillRow]) -> tuple[torch.Tensor, list[int]]:
    """Talker prefill; a fresh row samples its first c0, a re-prefilled (preempted) one keeps its own (-1)."""
    hidden, logits = talker.prefill(rows)
    talker.admit(rows)
    c0 = [-1] * len(rows)
    fresh = [i for i, r in enumerate(rows) if r.pending_c0 < 0]
    if fresh:
        sampled = talker.sample_first([rows[i] for i in fresh], logits[fresh]).tolist()
        for i, tok in zip(fresh, sampled):
            c0[i] = tok
    return hidden, c0


class InProcessExecutor:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, model_dir: str | Path,
                 device: torch.device, dtype: torch.dtype):
        self.talker = TalkerRunner(model_cfg, cfg, model_dir, device, dtype)
        self.predictor = PredictorRunner(model_cfg, cfg, model_dir, device, dtype)
        self.num_blocks = self.talker.num_blocks
        self.device = device
        # the talker's last hidden state per sequence slot: where the predictor starts the next frame
        self.hidden = torch.zeros(cfg.max_num_seqs, model_cfg.talker.hidden_size, dtype=dtype, device=device)

    def prefill(self, rows: list[PrefillRow]) -> list[int]:
        hidden, c0 = prefill_and_sample(self.talker, rows)
        self.predictor.admit(rows)
        self.hidden[[r.slot for r in rows]] = hidden
        return c0

    def decode(self, batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray]:
        """-> (codes [B, 16], next c0 [B])."""
        slots = torch.from_numpy(batch.slots).to(self.device)
        codes, frame_sum = self.predictor.run(batch, self.hidden[slots])
        hidden, c0 = self.talker.decode(batch, frame_sum)
        self.hidden[slots] = hidden
        return codes.cpu().numpy(), c0.cpu().numpy()

    def is_alive(self) -> bool:
        return True

    def recover(self) -> None:
        """Nothing to restart in-process."""

    def shutdown(self) -> None:
        pass
