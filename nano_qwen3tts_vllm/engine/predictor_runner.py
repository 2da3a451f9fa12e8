"""Runs the code predictor for a batch of frames: [talker hidden, E_0(c0)] -> c1 .. c15, each
sampled with the subtalker settings, plus the summed embedding of the finished frame."""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import EngineConfig, ModelConfig
from ..layers.attention import DenseAttention, DenseMetadata
from ..models.loader import load_weights
from ..models.predictor import CodePredictor
from .cuda_graphs import GraphPool, to_device
from .sampler import SamplingTensors, SlotSettings, sample
from .sequence import NUM_FRAMES, SLOT, DecodeBatch, PrefillRow


def predictor_settings(row: PrefillRow) -> dict:
    p = row.params
    return dict(do_sample=p.subtalker_dosample, temperature=p.subtalker_temperature if p.subtalker_dosample else 1.0,
                top_k=p.subtalker_top_k, top_p=p.subtalker_top_p, seeds=row.seed)


class PredictorRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, model_dir: str | Path,
                 device: torch.device, dtype: torch.dtype):
        self.cfg, self.model_cfg, self.device, self.dtype = cfg, model_cfg, device, dtype
        with torch.device(device):
            self.model = CodePredictor(model_cfg)
        load_weights(self.model, "predictor", model_dir, model_cfg)
        self.model.to(dtype).eval()
        c, g = model_cfg.predictor, model_cfg.num_code_groups
        shape = (c.num_layers, 2, cfg.max_num_seqs, g + 1, c.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        layers = [m for m in self.model.modules() if isinstance(m, DenseAttention)]
        fused = device.type == "cuda" and cfg.attention_backend != "torch"
        rows = torch.arange(cfg.max_num_seqs + 1, dtype=torch.int32, device=device)[:, None]
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            layer.rows = rows if fused else None
        self.positions = torch.arange(g + 1, device=device)  # views of it: no fill kernel per codebook step
        self.settings = SlotSettings(cfg.max_num_seqs, device)
        self.graphs = None
        if device.type == "cuda" and not cfg.enforce_eager:
            self.graphs = GraphPool(self._graph_body, *self._graph_rows(), cfg.max_num_seqs)

    def admit(self, rows: list[PrefillRow]) -> None:
        """Sequences (re)entering their slots: their subtalker sampling settings."""
        self.settings.set([r.slot for r in rows], [predictor_settings(r) for r in rows])

    def frame_step(self, hidden: torch.Tensor, c0: torch.Tensor, st: SamplingTensors,
                   frame_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, H] (talker, after final norm), c0 [B] -> codes [B, 16], frame embedding sum [B, H]."""
        model, B = self.model, hidden.shape[0]
        x = torch.stack([hidden, model.codec.lookup(0, c0)], dim=1)
        h, r = model(x, self.positions[:2].expand(B, 2), DenseMetadata(0, 2))
        h, r = h[:, -1], r[:, -1]
        counters = frame_idx * 16  # codebook k draws noise counter frame * 16 + k
        codes = [c0]
        for k in range(1, self.model_cfg.num_code_groups):
            ck = sample(model.logits(h, r, k - 1), st, counters, k)
            codes.append(ck)
            if k + 1 < self.model_cfg.num_code_groups:
                h, r = model.forward_codes(k, ck, self.positions[k + 1:k + 2].expand(B, 1), DenseMetadata(k + 1, k + 2))
                h, r = h[:, 0], r[:, 0]
        codes = torch.stack(codes, dim=1)
        return codes, model.codec.frame_sum(codes)

    @torch.inference_mode()
    def run(self, batch: DecodeBatch, hidden: torch.Tensor, c0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, H]: each sequence's last talker hidden state; c0 [B] (on the device or the host): the
        codebook-0 id each frame starts from -> (codes [B, 16], frame sums [B, H])."""
        inp = dict(rows=torch.from_numpy(batch.rows), hidden=hidden, c0=c0)
        if self.graphs is not None:
            return self.graphs.run(inp)
        return self._graph_body({k: to_device(v, self.device) for k, v in inp.items()})

    def _graph_body(self, inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = inp["rows"]
        return self.frame_step(inp["hidden"], inp["c0"], self.settings.gather(rows[:, SLOT]), rows[:, NUM_FRAMES])

    def _graph_rows(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        pad_row = torch.zeros(6, dtype=torch.long)
        pad_row[SLOT] = self.cfg.max_num_seqs
        rows = dict(rows=pad_row.to(self.device),
                    hidden=torch.zeros(self.model_cfg.talker.hidden_size, dtype=self.dtype, device=self.device),
                    c0=torch.zeros((), dtype=torch.long, device=self.device))
        return rows, dict(rows=pad_row)
