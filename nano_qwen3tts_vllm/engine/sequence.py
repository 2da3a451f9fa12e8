"""A request as the engine sees it: a prompt of embedding positions, then one position per frame."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from enum import Enum, auto

import numpy as np

from ..sampling_params import SamplingParams


@dataclass
class Prompt:
    """The talker's prefill, one row per position.

    Row i embeds as P(text_ids[i]) (skipped when -1) + sum over k of E_k(codes[i, k]) (skipped
    when -1), plus `speaker` at `speaker_pos` (a Base model's x-vector). `trailing_text_ids` are
    fed one per decode step (streaming text); tts_pad after them.
    """
    text_ids: np.ndarray                 # [L] int64
    codes: np.ndarray                    # [L, 16] int64
    trailing_text_ids: list[int]
    speaker: np.ndarray | None = None    # [hidden] float32
    speaker_pos: int = -1

    def __len__(self) -> int:
        return len(self.text_ids)


@dataclass
class PrefillRow:
    """What the talker's prefill needs of one sequence: small and picklable, so it can cross to a
    worker process. Counts are taken before the step. The seed and params are also what the
    runners keep per slot for the sequence's later decode steps (see DecodeBatch)."""
    slot: int
    seed: int
    params: SamplingParams
    num_c0: int                   # codebook-0 ids sampled so far
    num_tokens: int               # positions to have KV after the prefill
    num_cached_tokens: int        # leading positions already cached (prefix reuse)
    block_table: list[int]
    pending_c0: int = -1          # a re-prefilled (preempted) sequence's c0 still waiting for its frame
    c0_history: list[int] | None = None
    # positions [num_cached_tokens, num_tokens)
    text_ids: np.ndarray | None = None
    codes: np.ndarray | None = None
    speaker: np.ndarray | None = None
    speaker_row: int = -1         # index into text_ids where the speaker vector is added


# columns of DecodeBatch.rows
SLOT, NUM_C0, NUM_FRAMES, NUM_TOKENS, PENDING_C0, TEXT_ID = range(6)


@dataclass
class DecodeBatch:
    """One decode step of B running sequences as two integer arrays: cheap to build, to send to a
    worker and to copy into a CUDA graph's inputs. Everything else a runner needs (sampling settings,
    repetition history) it keeps per slot since the sequence's prefill."""
    rows: np.ndarray           # [B, 6] int64: slot, c0 sampled so far, frames so far, KV positions so far
    #                            (the step writes position num_tokens), the c0 this frame starts from
    #                            (-1 while the step that samples it is in flight: the in-process executor
    #                            keeps it on the device), the text id added to the frame fed back
    block_tables: np.ndarray   # [B, W] int32, padded with -1

    @property
    def slots(self) -> np.ndarray:
        return self.rows[:, SLOT]


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Positions 0..L-1 are the prompt; position L+t is frame t (its 16 codes + step t's text)."""
    _ids = itertools.count()

    def __init__(self, prompt: Prompt, params: SamplingParams, block_size: int, tts_pad_id: int,
                 seed: int, request_id: str | None = None, arrival: float | None = None):
        self.seq_id = next(Sequence._ids)
        self.arrival = time.monotonic() if arrival is None else arrival  # when it was submitted
        self.scheduled_at: float | None = None  # its first prefill
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt = prompt
        self.params = params
        self.block_size = block_size
        self.tts_pad_id = tts_pad_id
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.c0: list[int] = []            # sampled codebook-0 ids (one ahead of frames while running)
        self.frames: list[list[int]] = []  # finished frames, 16 codes each
        self.block_table: list[int] = []
        self.num_cached_tokens = 0         # leading positions whose KV came from the prefix cache
        self.slot = -1                     # row of per-sequence sampler state while running
        self.finish_reason: str | None = None
        self.inflight = 0                  # decode steps launched whose frame and c0 are not appended yet

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        """Positions whose KV exists (or will after the next prefill, or the steps in flight)."""
        return len(self.prompt) + len(self.frames) + self.inflight

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def has_pending_c0(self) -> bool:
        return len(self.c0) > len(self.frames)

    @property
    def finishes_in_flight(self) -> bool:
        """max_new_tokens is reached by the c0 of a step in flight (whatever it samples)."""
        return self.inflight > 0 and len(self.c0) + self.inflight >= self.params.max_new_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def step_text_id(self, t: int) -> int:
        trailing = self.prompt.trailing_text_ids
        return trailing[t] if t < len(trailing) else self.tts_pad_id

    def positions(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(text_ids [n], codes [n, 16]) of positions [start, end)."""
        L = len(self.prompt)
        text = [self.prompt.text_ids[start:min(end, L)]]
        codes = [self.prompt.codes[start:min(end, L)]]
        if end > L:
            t0 = max(start, L) - L
            text.append(np.array([self.step_text_id(t) for t in range(t0, end - L)], dtype=np.int64))
            codes.append(np.array(self.frames[t0:end - L], dtype=np.int64).reshape(-1, self.prompt.codes.shape[1]))
        return np.concatenate(text), np.concatenate(codes)

    def prefill_row(self) -> PrefillRow:
        start = self.num_cached_tokens
        row = PrefillRow(slot=self.slot, seed=self.seed, params=self.params, num_c0=len(self.c0),
                      num_tokens=self.num_tokens, num_cached_tokens=start, block_table=list(self.block_table),
                      pending_c0=self.c0[len(self.frames)] if self.has_pending_c0 else -1,
                      c0_history=list(self.c0))
        row.text_ids, row.codes = self.positions(start, self.num_tokens)
        p = self.prompt
        if p.speaker is not None and start <= p.speaker_pos < self.num_tokens:
            row.speaker, row.speaker_row = p.speaker, p.speaker_pos - start
        return row

    def decode_row(self) -> tuple[int, int, int, int, int, int]:
        """The next decode step's row, counting the steps in flight as done."""
        n = len(self.frames) + self.inflight
        pending = self.c0[n] if n < len(self.c0) else -1
        return self.slot, len(self.c0) + self.inflight, n, self.num_tokens, pending, self.step_text_id(n)

    def block_bytes(self, i: int) -> bytes:
        """Content of prompt block i for prefix hashing (speaker vector included)."""
        s, e = i * self.block_size, (i + 1) * self.block_size
        data = self.prompt.text_ids[s:e].tobytes() + self.prompt.codes[s:e].tobytes()
        if self.prompt.speaker is not None and s <= self.prompt.speaker_pos < e:
            data += self.prompt.speaker.astype(np.float32).tobytes()
        return data


def decode_batch(seqs: list[Sequence]) -> DecodeBatch:
    width = max(len(s.block_table) for s in seqs)
    tables = np.full((len(seqs), width), -1, dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_table)] = s.block_table
    return DecodeBatch(np.array([s.decode_row() for s in seqs], dtype=np.int64), tables)
