"""Runs the talker: batched varlen prefill and one-token decode over the paged KV cache,
then the codebook-0 sampler. Per-batch-size CUDA graphs cover the decode step with sampling."""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..config import EngineConfig, ModelConfig
from ..layers.attention import PagedAttention, PagedMetadata
from ..models.loader import load_weights
from ..models.talker import Talker
from .cuda_graphs import GraphPool, PrefillGraphs, to_device
from .sampler import SlotSettings, apply_penalties, sample
from .sequence import NUM_C0, NUM_TOKENS, SLOT, TEXT_ID, DecodeBatch, PrefillRow

logger = logging.getLogger(__name__)

PREFILL_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048)   # prompt tokens per prefill graph; larger ones run eagerly
TOKEN_INPUTS = ("text_ids", "codes", "positions", "slot_mapping")  # per token; the other inputs are per sequence


def talker_settings(row: PrefillRow) -> dict:
    p = row.params
    return dict(do_sample=p.do_sample, temperature=p.temperature if p.do_sample else 1.0, top_k=p.top_k,
                top_p=p.top_p, seeds=row.seed, penalty=p.repetition_penalty, min_new=p.min_new_tokens)


class TalkerRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, model_dir: str | Path,
                 device: torch.device, dtype: torch.dtype, before_kv: Callable[[], None] | None = None):
        """`before_kv` runs once the weights are loaded, before the KV cache takes its share of the memory left
        (a worker waits there until the processes sharing its GPU have loaded)."""
        self.cfg, self.model_cfg, self.device, self.dtype = cfg, model_cfg, device, dtype
        self.block_size = cfg.kvcache_block_size
        with torch.device(device):
            self.model = Talker(model_cfg, cfg.max_model_len + 1)
        load_weights(self.model, "talker", model_dir, model_cfg)
        self.model.to(dtype).eval()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        if before_kv is not None:
            before_kv()
        self.num_blocks = self._allocate_kv_cache()
        self.max_blocks_per_seq = (cfg.max_model_len + self.block_size - 1) // self.block_size
        V = model_cfg.codec_vocab_size
        # per slot: sampling settings and which c0 ids were generated; row max_num_seqs is scratch
        self.settings = SlotSettings(cfg.max_num_seqs, device,
                                     dict(penalty=(torch.float32, 1.0), min_new=(torch.long, 0)))
        self.seen = torch.zeros(cfg.max_num_seqs + 1, V, dtype=torch.bool, device=device)
        self.suppress = torch.zeros(V, dtype=torch.bool, device=device)
        self.suppress[model_cfg.suppressed_ids] = True
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self.graphs = self.prefill_graphs = None
        if device.type == "cuda" and not cfg.enforce_eager:
            self.graphs = GraphPool(self._decode_body, *self._graph_rows(), cfg.max_num_seqs)
            if self.attn_layers[0].backend == "triton":  # the torch prefill loops on the host: not capturable
                self.prefill_graphs = self._capture_prefill()

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

    def _slots(self, seq: PrefillRow, start: int, end: int) -> list[int]:
        bs = self.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- prefill --------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[PrefillRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute every uncached position; return (last hidden [B, H], codebook-0 logits [B, V] fp32).
        Attention is per sequence (the torch loop) or varlen (Triton, flash-attn), batch-invariant either way: a
        seeded request's audio does not depend on what it was prefilled with. With Triton on CUDA, prefills of up
        to PREFILL_BUCKETS[-1] tokens replay a CUDA graph of the next token bucket."""
        lens = [s.num_tokens - s.num_cached_tokens for s in seqs]
        B = len(seqs)
        if self.prefill_graphs is not None and sum(lens) <= self.prefill_graphs.max_tokens:
            bucket = self.prefill_graphs.bucket(sum(lens))
            arrays = self._prefill_arrays(seqs, lens, bucket, self.cfg.max_num_seqs, self.max_blocks_per_seq)
            hidden, logits = self.prefill_graphs.run(bucket, arrays)
            return hidden[:B], logits[:B]
        width = max(len(s.block_table) for s in seqs)
        inp = {k: torch.from_numpy(v).to(self.device) for k, v in self._prefill_arrays(seqs, lens, width=width).items()}
        seqlens_k = [s.num_tokens for s in seqs]
        has_prefix = any(q != k for q, k in zip(lens, seqlens_k))
        paged = has_prefix or self.attn_layers[0].backend == "triton"  # Triton reads all keys from the cache
        meta = PagedMetadata(
            is_prefill=True, slot_mapping=inp["slot_mapping"], seqlens_q=lens, seqlens_k=seqlens_k,
            cu_seqlens_q=inp["cu_seqlens_q"], context_lens=inp["context_lens"],
            cu_seqlens_k=torch.tensor(np.cumsum([0] + seqlens_k), dtype=torch.int32, device=self.device),
            block_tables=inp["block_tables"] if paged else None, has_prefix=has_prefix)
        return self._prefill_body(inp, meta)

    def _prefill_body(self, inp: dict[str, torch.Tensor], meta: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.model.embed(inp["text_ids"], inp["codes"])
        embeds = embeds.index_add(0, inp["speaker_row"], inp["speaker"].to(embeds.dtype))
        hidden = self.model(embeds, inp["positions"], meta)[inp["last"]]
        return hidden, self.model.codec_head(hidden).float()

    def _prefill_arrays(self, seqs: list[PrefillRow], lens: list[int], tokens: int = 0, num_seqs: int = 0,
                        width: int = 1) -> dict[str, np.ndarray]:
        """The prefill's inputs, packed: sequence b at rows starts[b] .. starts[b] + lens[b]. Padded (for a graph)
        to `tokens` rows and `num_seqs` sequences: padding tokens write the scratch KV block, padding sequences
        have no tokens and point at scratch."""
        starts = np.cumsum([0] + lens[:-1]).astype(np.int64)
        T, B, g = max(tokens, sum(lens)), max(num_seqs, len(seqs)), self.model_cfg.num_code_groups
        a = dict(text_ids=np.full(T, -1, dtype=np.int64), codes=np.full((T, g), -1, dtype=np.int64),
                 positions=np.zeros(T, dtype=np.int64),
                 slot_mapping=np.full(T, self.scratch_block * self.block_size, dtype=np.int64),
                 last=np.zeros(B, dtype=np.int64), speaker_row=np.zeros(B, dtype=np.int64),
                 speaker=np.zeros((B, self.model_cfg.talker.hidden_size), dtype=np.float32),
                 cu_seqlens_q=np.full(B + 1, sum(lens), dtype=np.int32), context_lens=np.zeros(B, dtype=np.int32),
                 block_tables=np.full((B, width), self.scratch_block, dtype=np.int32))
        a["cu_seqlens_q"][:len(seqs)] = starts[:len(seqs)]
        for b, (seq, n) in enumerate(zip(seqs, lens)):
            r = slice(starts[b], starts[b] + n)
            a["text_ids"][r], a["codes"][r] = seq.text_ids, seq.codes
            a["positions"][r] = np.arange(seq.num_cached_tokens, seq.num_tokens)
            a["slot_mapping"][r] = self._slots(seq, seq.num_cached_tokens, seq.num_tokens)
            a["last"][b], a["speaker_row"][b], a["context_lens"][b] = starts[b] + n - 1, starts[b], seq.num_tokens
            a["block_tables"][b, :len(seq.block_table)] = seq.block_table
            if seq.speaker is not None:  # a Base model's x-vector, added to one position
                a["speaker"][b], a["speaker_row"][b] = seq.speaker, starts[b] + seq.speaker_row
        return a

    def _padded_prefill_body(self, inp: dict[str, torch.Tensor], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The capturable prefill (Triton attention): inputs padded to `tokens` rows and max_num_seqs sequences;
        `tokens` sizes the attention grid, whose programs past a sequence's end return at once."""
        meta = PagedMetadata(is_prefill=True, slot_mapping=inp["slot_mapping"], seqlens_q=[tokens],
                             cu_seqlens_q=inp["cu_seqlens_q"], context_lens=inp["context_lens"],
                             block_tables=inp["block_tables"])
        return self._prefill_body(inp, meta)

    def _capture_prefill(self) -> PrefillGraphs:
        empty = self._prefill_arrays([], [], PREFILL_BUCKETS[-1], self.cfg.max_num_seqs, self.max_blocks_per_seq)
        return PrefillGraphs(self._padded_prefill_body, empty, TOKEN_INPUTS, PREFILL_BUCKETS, self.device)

    def admit(self, rows: list[PrefillRow]) -> None:
        """Sequences (re)entering their slots: their sampling settings and codebook-0 history so far."""
        self.settings.set([r.slot for r in rows], [talker_settings(r) for r in rows])
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long, device=self.device)
        self.seen[slots] = False
        for r in rows:
            if r.c0_history:
                self.seen[r.slot, r.c0_history] = True

    def sample_first(self, rows: list[PrefillRow], logits: torch.Tensor) -> torch.Tensor:
        """c0 of frame 0 from the prefill's logits (rows already admitted)."""
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long, device=self.device)
        num_c0 = torch.tensor([r.num_c0 for r in rows], dtype=torch.long, device=self.device)
        return self._sample_c0(slots, num_c0, logits)

    def _sample_c0(self, slots: torch.Tensor, num_c0: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        s = self.settings
        logits = apply_penalties(logits, self.seen[slots], s["penalty"][slots], num_c0 < s["min_new"][slots],
                                 self.model_cfg.codec_eos_id, self.suppress)
        c0 = sample(logits, s.gather(slots), num_c0 * 16)
        # index_put_ with a device-resident True: a Python scalar here would be a host copy (illegal in capture)
        self.seen.index_put_((slots, c0), self._true)
        return c0

    # ---- decode ---------------------------------------------------------------------------
    def load_decode(self, batch: DecodeBatch) -> None:
        """Stage a step's index inputs (before its frame embeddings exist: a worker does this while the
        predictor is still running)."""
        tables = np.where(batch.block_tables < 0, self.scratch_block, batch.block_tables)
        inp = dict(rows=torch.from_numpy(batch.rows), block_tables=torch.from_numpy(tables))
        if self.graphs is not None:
            self.graphs.load(inp)
        else:
            self._eager = {k: to_device(v, self.device) for k, v in inp.items()}

    @torch.inference_mode()
    def run_decode(self, frame_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """frame_sum [B, H]: each sequence's newest frame embedding -> (hidden [B, H], next c0 [B])."""
        if self.graphs is not None:
            self.graphs.load(dict(frame_sum=frame_sum))
            return self.graphs.replay(frame_sum.shape[0])
        return self._decode_body(dict(self._eager, frame_sum=frame_sum))

    def decode(self, batch: DecodeBatch, frame_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.load_decode(batch)
        return self.run_decode(frame_sum)

    def _decode_body(self, inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph-capturable step: positions, cache slots and settings all come from the rows."""
        rows, tables = inp["rows"], inp["block_tables"]
        slots, num_c0, pos = rows[:, SLOT], rows[:, NUM_C0], rows[:, NUM_TOKENS]
        bs = self.block_size
        slot_mapping = tables.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs
        meta = PagedMetadata(is_prefill=False, slot_mapping=slot_mapping, context_lens=(pos + 1).int(),
                             block_tables=tables)
        hidden = self.model(inp["frame_sum"] + self.model.text(rows[:, TEXT_ID]), pos, meta)
        return hidden, self._sample_c0(slots, num_c0, self.model.codec_head(hidden).float())

    def _graph_rows(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """An example row of each input, and the padding rows (slot and KV writes go to scratch)."""
        pad_row = torch.zeros(6, dtype=torch.long)
        pad_row[SLOT], pad_row[TEXT_ID] = self.cfg.max_num_seqs, self.model_cfg.tts_pad_id
        padding = dict(rows=pad_row, block_tables=torch.full((self.max_blocks_per_seq,), self.scratch_block,
                                                             dtype=torch.int32))
        rows = dict(padding, frame_sum=torch.zeros(self.model_cfg.talker.hidden_size, dtype=self.dtype))
        return {k: v.to(self.device) for k, v in rows.items()}, padding
