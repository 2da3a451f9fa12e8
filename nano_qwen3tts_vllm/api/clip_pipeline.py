"""Whole clips decoded while they are still being generated (generate_* on CUDA).

Decoding after generation adds the whole decode to a batch's wall time, while the engine's steps leave part of
the GPU idle. Here the caller's thread reads the frames of every request as the engine thread produces them and
feeds each batch of clips to the codec decoder a piece at a time, on a CUDA stream of its own, so the decode runs
beside the engine's steps. The chunking is qwen-tts's (`ClipBatch`), so the audio is what decoding the finished
clips would give.
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import nullcontext
from typing import Iterator

import torch

from ..engine.cuda_graphs import to_device
from ..models.codec_decoder import ClipBatch, StreamingCodecDecoder

GROUP = 64      # clips per decoder batch
IN_FLIGHT = 2   # pieces queued on the GPU at most: launches into a full CUDA launch queue would block


def decode_while_generating(dec: StreamingCodecDecoder, frames: list[Iterator[list[int]]],
                            prefixes: list[torch.Tensor | None], stream: torch.cuda.Stream | None = None,
                            group: int = GROUP) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Read every iterator of frames (16 codes each) to its end; returns per clip its codes [T_i, Q] (prefix, e.g.
    ICL reference codes, then the frames) and its audio [T_i * upsample] on the decoder's device. `stream`: the
    CUDA stream to decode on (None: the current one, e.g. on CPU)."""
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        # every tensor of the decode lives on `stream`: one made on another stream could be read before it is
        # written there, or be handed out again by the allocator while this stream still reads it
        clips, audio = _decode(dec, frames, prefixes, stream, group)
    if stream is not None:
        stream.synchronize()  # the audio is read on other streams
    return [torch.tensor(c, dtype=torch.long).reshape(-1, dec.num_quantizers) for c in clips], audio


def _decode(dec: StreamingCodecDecoder, frames: list[Iterator[list[int]]], prefixes: list[torch.Tensor | None],
            stream: torch.cuda.Stream | None, group: int) -> tuple[list[list], list[torch.Tensor]]:
    clips = [[] if p is None else p.tolist() for p in prefixes]
    ended = [False] * len(frames)
    batches = [(rows, ClipBatch(dec, len(rows)))
               for rows in (list(range(g, min(g + group, len(frames)))) for g in range(0, len(frames), group))]
    audio: list[torch.Tensor | None] = [None] * len(frames)
    queued: deque[torch.cuda.Event] = deque()
    while batches:
        for rows, batch in list(batches):
            need = batch.next_piece()[1]
            for i in rows:
                while not ended[i] and len(clips[i]) < need:
                    try:
                        clips[i].append(next(frames[i]))
                    except StopIteration:
                        ended[i] = True
            total = max(len(clips[i]) for i in rows) if all(ended[i] for i in rows) else None
            span = batch.next_piece(total)
            if span is None:  # every clip ended and every piece is decoded
                wav = batch.audio()
                for row, i in enumerate(rows):
                    audio[i] = wav[row, :len(clips[i]) * dec.upsample]
                batches.remove((rows, batch))
                continue
            s, e = span
            codes = torch.zeros(len(rows), e - s, dec.num_quantizers, dtype=torch.long)
            for row, i in enumerate(rows):  # a clip that ended early is padded: causal, its audio is unaffected
                part = clips[i][s:e]
                if part:
                    codes[row, :len(part)] = torch.tensor(part)
            if stream is not None:
                _wait(queued, IN_FLIGHT - 1)
            batch.feed(to_device(codes, dec.device))
            if stream is not None:
                queued.append(torch.cuda.Event())
                queued[-1].record()
    return clips, audio


def _wait(queued: deque, keep: int) -> None:
    """Until at most `keep` recorded events are pending; sleeps between polls, so the engine thread runs."""
    while len(queued) > keep:
        event = queued.popleft()
        while not event.query():
            time.sleep(0.0005)
