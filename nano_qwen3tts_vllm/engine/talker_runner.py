"""Runs the talker: batched varlen prefill and one-token decode over the paged KV cache,
then the codebook-0 sampler. Per-batch-size CUDA graphs cover the decode step with sampling."""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import torch

from ..config import EngineConfig, ModelConfig
from ..layers.attention import PagedAttention, PagedMetadata
from ..models.loader import load_weights
from ..models.talker import Talker
from .cuda_graphs import GraphPool
from .sampler import SamplingTensors, apply_penalties, sample
from .sequence import StepRow

logger = logging.getLogger(__name__)


def talker_sampling(seqs: list[StepRow], device) -> SamplingTensors:
    return SamplingTensors.build([(s.params.do_sample, s.params.temperature if s.params.do_sample else 1.0,
                                   s.params.top_k, s.params.top_p, s.seed) for s in seqs], device)


class TalkerRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, model_dir: str | Path,
                 device: torch.device, dtype: torch.dtype):
        self.cfg, self.model_cfg, self.device, self.dtype = cfg, model_cfg, device, dtype
        self.block_size = cfg.kvcache_block_size
        with torch.device(device):
            self.model = Talker(model_cfg, cfg.max_model_len + 1)
        load_weights(self.model, "talker", model_dir, model_cfg)
        self.model.to(dtype).eval()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self.num_blocks = self._allocate_kv_cache()
        self.max_blocks_per_seq = (cfg.max_model_len + self.block_size - 1) // self.block_size
        V = model_cfg.codec_vocab_size
        # row max_num_seqs is scratch for padded graph rows
        self.seen = torch.zeros(cfg.max_num_seqs + 1, V, dtype=torch.bool, device=device)
        self.suppress = torch.zeros(V, dtype=torch.bool, device=device)
        self.suppress[model_cfg.suppressed_ids] = True
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self.graphs = None
        if device.type == "cuda" and not cfg.enforce_eager:
            self.graphs = GraphPool(self._graph_body, self._graph_padding(), cfg.max_num_seqs)

    # ---- KV cache -------------------------------------------------------------------------
    def _allocate_kv_cache(self) -> int:
        c = self.model_cfg.talker
        per_block = 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        if self.cfg.num_kvcache_blocks > 0:
            num_blocks = self.cfg.num_kvcache_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.cfg.gpu_memory_utilization)
            num_blocks = int(budget // per_block)
            if num_blocks < 1:
                raise RuntimeError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free); "
                                   "raise gpu_memory_utilization or free the GPU")
        else:
            num_blocks = self.cfg.max_num_seqs * ((self.cfg.max_model_len + self.block_size - 1) // self.block_size)
        backend = self._attention_backend()
        shape = (c.num_layers, 2, num_blocks + 1, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
            layer.backend = backend
        logger.info("talker KV cache: %d blocks of %d positions (%.2f GiB), %s attention", num_blocks,
                    self.block_size, self.kv_cache.numel() * self.dtype.itemsize / 2**30, backend)
        return num_blocks

    def _attention_backend(self) -> str:
        """auto: flash-attn if installed and usable (bf16/fp16, blocks of 256), else Triton on CUDA, else PyTorch."""
        want, cuda = self.cfg.attention_backend, self.device.type == "cuda"
        flash_ok = cuda and self.dtype in (torch.float16, torch.bfloat16) and self.block_size % 256 == 0
        if want == "auto":
            if flash_ok and importlib.util.find_spec("flash_attn") is not None:
                return "flash"
            return "triton" if cuda else "torch"
        if want in ("triton", "flash") and not cuda:
            raise ValueError(f"attention_backend={want!r} needs CUDA; use 'torch' on {self.device.type}")
        if want == "flash" and not flash_ok:
            raise ValueError("attention_backend='flash' needs bf16/fp16 and kvcache_block_size a multiple of 256")
        return want

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def _slots(self, seq: StepRow, start: int, end: int) -> list[int]:
        bs = self.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _block_tables(self, seqs: list[StepRow], width: int) -> torch.Tensor:
        rows = [s.block_table + [self.scratch_block] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    # ---- prefill --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[StepRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute every uncached position; return (last hidden [B, H], codebook-0 logits [B, V] fp32)."""
        text, codes, positions, slots, seqlens_q, seqlens_k = [], [], [], [], [], []
        speaker_rows, speaker_vecs = [], []
        offset = 0
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_tokens
            text.append(seq.text_ids)
            codes.append(seq.codes)
            positions.append(np.arange(start, end))
            slots += self._slots(seq, start, end)
            seqlens_q.append(end - start)
            seqlens_k.append(end)
            if seq.speaker is not None:
                speaker_rows.append(offset + seq.speaker_row)
                speaker_vecs.append(seq.speaker)
            offset += end - start
        dev = self.device
        embeds = self.model.embed(torch.from_numpy(np.concatenate(text)).to(dev),
                                  torch.from_numpy(np.concatenate(codes)).to(dev))
        if speaker_rows:
            embeds[speaker_rows] += torch.from_numpy(np.stack(speaker_vecs)).to(dev, self.dtype)
        cu_q = torch.tensor(np.cumsum([0] + seqlens_q), dtype=torch.int32, device=dev)
        has_prefix = any(q != k for q, k in zip(seqlens_q, seqlens_k))
        meta = PagedMetadata(
            is_prefill=True, slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            seqlens_q=seqlens_q, seqlens_k=seqlens_k, cu_seqlens_q=cu_q,
            cu_seqlens_k=torch.tensor(np.cumsum([0] + seqlens_k), dtype=torch.int32, device=dev),
            block_tables=self._block_tables(seqs, max(len(s.block_table) for s in seqs)) if has_prefix else None,
            has_prefix=has_prefix)
        pos = torch.from_numpy(np.concatenate(positions)).to(dev)
        hidden = self.model(embeds, pos, meta)[cu_q[1:].long() - 1]
        return hidden, self.model.codec_head(hidden).float()

    def reset_history(self, seqs: list[StepRow]) -> None:
        """Point each sequence's (possibly new) sampler slot at its codebook-0 history so far."""
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)
        self.seen[slots] = False
        for s in seqs:
            if s.c0_history:
                self.seen[s.slot, s.c0_history] = True

    def sample_first(self, seqs: list[StepRow], logits: torch.Tensor) -> torch.Tensor:
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)
        return self._sample(seqs, slots, logits)

    def _sample(self, seqs: list[StepRow], slots: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        dev = self.device
        penalty = torch.tensor([s.params.repetition_penalty for s in seqs], dtype=torch.float32, device=dev)
        block_eos = torch.tensor([s.num_c0 < s.params.min_new_tokens for s in seqs], device=dev)
        counters = torch.tensor([s.num_c0 * 16 for s in seqs], dtype=torch.long, device=dev)
        logits = apply_penalties(logits, self.seen[slots], penalty, block_eos, self.model_cfg.codec_eos_id,
                                 self.suppress)
        c0 = sample(logits, talker_sampling(seqs, dev), counters)
        self._mark_seen(slots, c0)
        return c0

    def _mark_seen(self, slots: torch.Tensor, c0: torch.Tensor) -> None:
        # index_put_ with a device-resident True: a Python scalar here would be a host copy (illegal in capture)
        self.seen.index_put_((slots, c0), self._true)

    # ---- decode ---------------------------------------------------------------------------
    def decode_inputs(self, seqs: list[StepRow]) -> dict[str, torch.Tensor]:
        """Inputs of one decode step: each sequence feeds back its newest frame at position num_tokens."""
        dev = self.device
        positions = [s.num_tokens for s in seqs]
        return dict(
            text_ids=torch.tensor([s.step_text_id for s in seqs], dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor([self._slots(s, p, p + 1)[0] for s, p in zip(seqs, positions)],
                                      dtype=torch.long, device=dev),
            context_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=dev),
            block_tables=self._block_tables(seqs, max(len(s.block_table) for s in seqs)),
            slots=torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev),
            penalty=torch.tensor([s.params.repetition_penalty for s in seqs], dtype=torch.float32, device=dev),
            block_eos=torch.tensor([s.num_c0 < s.params.min_new_tokens for s in seqs], device=dev),
            counters=torch.tensor([s.num_c0 * 16 for s in seqs], dtype=torch.long, device=dev),
        )

    def decode_step(self, frame_sum: torch.Tensor, inp: dict[str, torch.Tensor], st: SamplingTensors):
        """The graph-capturable body: embed, run, sample, record the sampled id as seen."""
        embeds = frame_sum + self.model.text(inp["text_ids"])
        meta = PagedMetadata(is_prefill=False, slot_mapping=inp["slot_mapping"],
                             context_lens=inp["context_lens"], block_tables=inp["block_tables"])
        hidden = self.model(embeds, inp["positions"], meta)
        logits = self.model.codec_head(hidden).float()
        logits = apply_penalties(logits, self.seen[inp["slots"]], inp["penalty"], inp["block_eos"],
                                 self.model_cfg.codec_eos_id, self.suppress)
        c0 = sample(logits, st, inp["counters"])
        self._mark_seen(inp["slots"], c0)
        return hidden, c0, logits

    @torch.inference_mode()
    def decode(self, seqs: list[StepRow], frame_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inp = self.decode_inputs(seqs)
        st = talker_sampling(seqs, self.device)
        if self.graphs is not None:
            return self.graphs.run(dict(inp, frame_sum=frame_sum, **st.as_dict()))
        hidden, c0, _ = self.decode_step(frame_sum, inp, st)
        return hidden, c0

    def _graph_body(self, inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        st = SamplingTensors.from_dict(inp)
        hidden, c0, _ = self.decode_step(inp["frame_sum"], inp, st)
        return hidden, c0

    def _graph_padding(self) -> dict[str, torch.Tensor]:
        """Padding rows: write KV into the scratch block, sampler state into the scratch row."""
        dev, i64 = self.device, torch.long
        pad = dict(
            frame_sum=torch.zeros(self.model_cfg.talker.hidden_size, dtype=self.dtype, device=dev),
            text_ids=torch.tensor(self.model_cfg.tts_pad_id, dtype=i64, device=dev),
            positions=torch.tensor(0, dtype=i64, device=dev),
            slot_mapping=torch.tensor(self.scratch_block * self.block_size, dtype=i64, device=dev),
            context_lens=torch.tensor(1, dtype=torch.int32, device=dev),
            block_tables=torch.full((self.max_blocks_per_seq,), self.scratch_block, dtype=torch.int32, device=dev),
            slots=torch.tensor(self.cfg.max_num_seqs, dtype=i64, device=dev),
            penalty=torch.tensor(1.0, device=dev),
            block_eos=torch.tensor(False, device=dev),
            counters=torch.tensor(0, dtype=i64, device=dev),
        )
        return dict(pad, **SamplingTensors.padding(dev))
