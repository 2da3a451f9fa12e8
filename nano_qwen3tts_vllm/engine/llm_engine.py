"""The engine loop: schedule, run the talker (prefill) or predictor + talker (decode), book-keep. Consecutive
decode steps are pipelined (async scheduling): step t+1 is launched before step t's results are read."""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..config import EngineConfig, ModelConfig
from ..sampling_params import SamplingParams
from .executor import InProcessExecutor
from .scheduler import Scheduler
from .sequence import Prompt, Sequence, decode_batch

logger = logging.getLogger(__name__)


@dataclass
class LatencyStats:
    """Sums over the requests that reached their first frame (Prometheus summaries): seconds from submission to
    the first prefill (queueing), and to the first frame."""
    count: int = 0
    queued_s: float = 0.0
    first_frame_s: float = 0.0

    def record(self, seq: Sequence) -> None:
        now = time.monotonic()
        self.count += 1
        self.queued_s += seq.scheduled_at - seq.arrival
        self.first_frame_s += now - seq.arrival


@dataclass
class DecodeStep:
    """A launched decode step: its sequences in batch order and the executor's handle of its results."""
    seqs: list[Sequence]
    handle: object


@dataclass
class StepOutput:
    request_id: str
    frame: list[int] | None          # the 16 codes of a frame finished this step
    finished: bool
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_new_tokens), "abort"


class LLMEngine:
    """Scheduling and book-keeping; the model work runs in an executor: in this process, or in a
    talker and a predictor worker process (`multiprocess=True`, optionally on different devices).
    `before_kv` is called before the talker sizes its KV cache from the GPU memory left (to wait for other
    processes loading on the same GPU)."""

    def __init__(self, model_dir: str | Path, cfg: EngineConfig | None = None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 multiprocess: bool = False, talker_device: str | None = None, predictor_device: str | None = None,
                 before_kv: Callable[[], None] | None = None):
        self.cfg = cfg or EngineConfig()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model_cfg = ModelConfig.from_pretrained(model_dir)
        if multiprocess:
            from ..workers.executor import MultiprocessExecutor
            self.executor = MultiprocessExecutor(model_dir, self.cfg, torch.device(talker_device or self.device),
                                                 torch.device(predictor_device or self.device), self.dtype,
                                                 before_kv=before_kv)
        else:
            if (talker_device or predictor_device) and torch.device(talker_device or self.device) != torch.device(
                    predictor_device or self.device):
                raise ValueError("talker and predictor on different devices needs multiprocess=True")
            self.executor = InProcessExecutor(self.model_cfg, self.cfg, model_dir, self.device, self.dtype,
                                              before_kv)
        self.scheduler = Scheduler(self.cfg, self.executor.num_blocks)
        self.seqs: dict[str, Sequence] = {}
        self.pipelined = self.cfg.async_scheduling and self.executor.pipelined
        self._inflight: DecodeStep | None = None
        self._seed_rng = random.SystemRandom()
        self.latency = LatencyStats()
        if self.device.type == "cuda":
            self.warmup()
            self.latency = LatencyStats()  # without the warm-up requests

    def warmup(self) -> None:
        """Run a few throwaway requests so one-time work (kernel compilation for the prefill
        shapes, allocator growth) happens now rather than in the first users' first audio."""
        import numpy as np
        g = self.model_cfg.num_code_groups

        def prompt(n: int) -> Prompt:
            return Prompt(text_ids=np.full(n, self.model_cfg.tts_pad_id, dtype=np.int64),
                          codes=np.full((n, g), -1, dtype=np.int64), trailing_text_ids=[])
        for batch in ([7], [5, 9, 12]):
            params = [SamplingParams(max_new_tokens=3, seed=i, do_sample=i % 2 == 0) for i in range(len(batch))]
            self.generate([prompt(n) for n in batch], params)

    @property
    def max_frames(self) -> int:
        """The most codec positions one sequence can hold (prompt + frames)."""
        return min(self.cfg.max_model_len, self.executor.num_blocks * self.cfg.kvcache_block_size)

    def check_fits(self, prompt: Prompt, params: SamplingParams) -> None:
        # the last sampled c0 never gets a frame, so a sequence needs L + max_new_tokens - 1 positions
        need = len(prompt) + params.max_new_tokens - 1
        if need > self.max_frames:
            raise ValueError(f"prompt of {len(prompt)} positions + max_new_tokens={params.max_new_tokens} needs "
                             f"{need} KV positions; the engine holds at most {self.max_frames} per sequence "
                             "(lower max_new_tokens, shorten the text, or raise max_model_len)")

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    arrival: float | None = None) -> Sequence:
        """arrival: when it was submitted (time.monotonic(); default now)."""
        self.check_fits(prompt, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(prompt, params, self.cfg.kvcache_block_size, self.model_cfg.tts_pad_id, seed, request_id,
                       arrival)
        if seq.request_id in self.seqs:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished() or self._inflight is not None

    def step(self) -> list[StepOutput]:
        """Prefill or decode; returns the outputs of the step collected now. Pipelined, the next decode step is
        launched before this one's results are waited for, so the device runs it during this one's book-keeping
        (and the caller's delivery): outputs lag the device by one step."""
        if self._inflight is None:
            seqs, is_prefill = self.scheduler.schedule()
            if not seqs:
                return []
            if is_prefill:
                return self._prefill(seqs)
            self._inflight = self._launch(seqs)
        step, self._inflight = self._inflight, None
        if self.pipelined:
            self._inflight = self._launch_next()
        return self._collect(step)

    def _prefill(self, seqs: list[Sequence]) -> list[StepOutput]:
        c0 = self.executor.prefill([s.prefill_row() for s in seqs])
        outputs = []
        for seq, tok in zip(seqs, c0):
            if tok >= 0:  # -1: a re-prefilled (preempted) sequence keeps the c0 it had
                out = self._append_c0(seq, tok)
                if out:
                    outputs.append(out)
        return outputs

    def _launch(self, seqs: list[Sequence]) -> DecodeStep:
        handle = self.executor.launch_decode(decode_batch(seqs))
        for seq in seqs:
            seq.inflight += 1
        return DecodeStep(seqs, handle)

    def _launch_next(self) -> DecodeStep | None:
        """The next decode step while one is in flight, on the assumption that none of its sequences stops
        (EOS) in it; None where the scheduler needs the step collected first."""
        seqs = self.scheduler.schedule_next_decode()
        return self._launch(seqs) if seqs else None

    def _collect(self, step: DecodeStep) -> list[StepOutput]:
        codes, c0 = self.executor.collect(step.handle)
        outputs = []
        for seq, frame, tok in zip(step.seqs, codes.tolist(), c0.tolist()):
            seq.inflight -= 1
            # Aborted, or stopped (EOS) in the step before, after this one was launched: drop its results. Its
            # blocks and slot were freed while this step ran, which is safe: whatever reuses them (another
            # sequence's KV write, a prefill into the slot) is launched after this step on the same stream, so it
            # runs after this step's writes; and a block's next owner reads only positions it wrote itself, but
            # for prefix-cache hits: full prompt blocks, never the frame position this step wrote.
            if seq.is_finished:
                continue
            seq.frames.append(frame)
            if len(seq.frames) == 1:
                self.latency.record(seq)
            out = StepOutput(seq.request_id, frame, False)
            done = self._append_c0(seq, tok)
            if done:
                out.finished, out.finish_reason = True, done.finish_reason
            outputs.append(out)
        return outputs

    def is_alive(self) -> bool:
        return self.executor.is_alive()

    def recover(self) -> None:
        """After a failed step (whose requests were failed): restart the workers if they died."""
        self.executor.recover()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _append_c0(self, seq: Sequence, tok: int) -> StepOutput | None:
        seq.c0.append(tok)
        reason = None
        if tok == self.model_cfg.codec_eos_id:
            reason = "stop"
        elif len(seq.c0) >= seq.params.max_new_tokens:
            reason = "length"
        if reason is None:
            return None
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        return StepOutput(seq.request_id, None, True, reason)

    def generate(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[list[list[int]]]:
        """Run to completion; frames (16 codes each) per prompt, in order."""
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.has_unfinished():
            self.step()
        return [s.frames for s in seqs]
