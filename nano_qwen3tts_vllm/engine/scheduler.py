"""Continuous batching: each step is either a batched prefill of waiting sequences or one decode
step for every running sequence; when blocks run out, the newest running sequence is preempted
(its KV freed, recomputed later), so the engine never crashes or hangs on a full cache."""
from __future__ import annotations

import logging
import time
from collections import deque

from ..config import EngineConfig
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, cfg: EngineConfig, num_blocks: int):
        self.max_num_seqs = cfg.max_num_seqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.block_manager = BlockManager(num_blocks, cfg.kvcache_block_size, cfg.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled: list[Sequence] = []
        num_batched = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if (num_batched + seq.num_tokens > self.max_num_batched_tokens
                    or not self.block_manager.can_allocate(seq)):
                break
            self.block_manager.allocate(seq)
            num_batched += seq.num_tokens - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            seq.slot = self.free_slots.pop()
            if seq.scheduled_at is None:
                seq.scheduled_at = time.monotonic()
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True

        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def schedule_next_decode(self) -> list[Sequence] | None:
        """While a decode step is in flight: the next one, for the running sequences that do not reach
        max_new_tokens with it, with their blocks appended. None where the engine must collect the step in
        flight first and schedule() anew: nothing would run, a waiting sequence may be admitted, or a
        sequence would have to be preempted."""
        seqs = [s for s in self.running if not s.finishes_in_flight]
        if not seqs or self._may_admit(finishing=len(self.running) - len(seqs)):
            return None
        bm = self.block_manager
        if sum(bm.needs_block(s) for s in seqs) > bm.num_free_blocks:
            return None
        for seq in seqs:
            bm.may_append(seq)
        return seqs

    def _may_admit(self, finishing: int) -> bool:
        """Whether schedule() may admit the first waiting sequence once `finishing` running ones are done
        (the blocks they free are not counted: any finishing sequence may make room)."""
        if not self.waiting or len(self.running) - finishing >= self.max_num_seqs:
            return False
        return finishing > 0 or self.block_manager.can_allocate(self.waiting[0])

    def preempt(self, seq: Sequence) -> None:
        logger.debug("preempting sequence %s at %d frames", seq.request_id, len(seq.frames))
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._release(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.block_manager.deallocate(seq)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1
