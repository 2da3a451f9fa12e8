"""Where the model work of a step runs. The in-process executor calls the two runners directly;
`workers.executor.MultiprocessExecutor` does the same through a talker and a predictor process."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..config import EngineConfig, ModelConfig
from .cuda_graphs import to_device
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


@dataclass
class DecodeHandle:
    """A launched decode step's results: in host memory once `done` has fired (None: they are already)."""
    codes: torch.Tensor              # [B, 16]
    c0: torch.Tensor                 # [B]
    done: torch.cuda.Event | None = None


class InProcessExecutor:
    pipelined = True  # every input of a decode step is on the host or in this executor's device buffers

    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, model_dir: str | Path,
                 device: torch.device, dtype: torch.dtype, before_kv: Callable[[], None] | None = None):
        self.talker = TalkerRunner(model_cfg, cfg, model_dir, device, dtype, before_kv)
        self.predictor = PredictorRunner(model_cfg, cfg, model_dir, device, dtype)
        self.num_blocks = self.talker.num_blocks
        self.device = device
        # per sequence slot, where the predictor starts the next frame: the talker's last hidden state and the
        # c0 it sampled (kept here, not read from the host rows, so a step can launch before the last one is read)
        self.hidden = torch.zeros(cfg.max_num_seqs, model_cfg.talker.hidden_size, dtype=dtype, device=device)
        self.c0 = torch.zeros(cfg.max_num_seqs, dtype=torch.long, device=device)

    def prefill(self, rows: list[PrefillRow]) -> list[int]:
        hidden, c0 = prefill_and_sample(self.talker, rows)
        self.predictor.admit(rows)
        slots = [r.slot for r in rows]
        self.hidden[slots] = hidden
        pending = [tok if tok >= 0 else r.pending_c0 for tok, r in zip(c0, rows)]
        self.c0[slots] = torch.tensor(pending, dtype=torch.long, device=self.device)
        return c0

    def launch_decode(self, batch: DecodeBatch) -> DecodeHandle:
        """Queue a decode step (predictor, then talker) behind the ones before it; on CUDA nothing here waits
        for the device, so the rows may count steps still in flight."""
        slots = to_device(torch.from_numpy(np.ascontiguousarray(batch.slots)), self.device)
        codes, frame_sum = self.predictor.run(batch, self.hidden[slots], self.c0[slots])
        hidden, c0 = self.talker.decode(batch, frame_sum)
        self.hidden[slots] = hidden
        self.c0[slots] = c0
        if self.device.type != "cuda":
            return DecodeHandle(codes, c0)
        # the outputs are graph buffers the next step overwrites: copied out before it, in stream order
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (codes, c0)]
        for h, t in zip(host, (codes, c0)):
            h.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return DecodeHandle(*host, done)

    def collect(self, handle: DecodeHandle) -> tuple[np.ndarray, np.ndarray]:
        """-> (codes [B, 16], next c0 [B]) of a launched step, waiting for it if it still runs."""
        if handle.done is not None:
            handle.done.synchronize()
        return handle.codes.cpu().numpy(), handle.c0.cpu().numpy()

    def is_alive(self) -> bool:
        return True

    def recover(self) -> None:
        """Nothing to restart in-process."""

    def shutdown(self) -> None:
        pass
