"""The codec (waveform) decoder in its own process, batched across streams.

Each stream is opened on a decoder slot (the client owns the slot pool), sends its chunks of new frames,
and is closed; the worker keeps every stream's decoder state. Whenever it is free it decodes the oldest
waiting chunk of every stream, chunks of equal length in one batch, so a stream's chunks run in order.
The client side resolves one future per chunk."""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from pathlib import Path

import numpy as np
import torch
import zmq

from ..gc_pauses import freeze_startup_objects, log_long_pauses
from ..models.codec_decoder import CodecGraphs, CodecStream, SlotPool, StreamingCodecDecoder
from .protocol import launch, make_socket, poll, recv, send

logger = logging.getLogger(__name__)


class CodecWorker:
    """Worker side: each open stream's slot and its chunks waiting in order."""

    def __init__(self, decoder: StreamingCodecDecoder, results: zmq.Socket, max_batch: int):
        self.dec, self.results, self.max_batch = decoder, results, max_batch
        self.batched = CodecGraphs(decoder, min(max_batch, 64)) if decoder.device.type == "cuda" else decoder
        self.slot: dict[int, int] = {}                                  # stream -> slot
        self.queue: dict[int, deque[tuple[int, torch.Tensor]]] = {}     # stream -> (job id, codes [T, Q])
        self.broken: dict[int, str] = {}                                # stream -> why it cannot go on

    def has_work(self) -> bool:
        return any(self.queue.values())

    def handle(self, header: dict, tensors: list[torch.Tensor]) -> None:
        op, sid = header["op"], header.get("stream")
        if op == "open":
            self._open(sid, header["slot"], tensors[0] if tensors else None)
        elif op == "decode":
            if sid not in self.slot:
                self._fail([header["id"]], f"stream {sid} is not open in the codec worker")
            elif sid in self.broken:
                self._fail([header["id"]], self.broken[sid])
            else:
                self.queue[sid].append((header["id"], tensors[0]))
        elif op == "close":
            self._forget(sid)
        else:
            logger.error("unknown message %r", op)

    def _open(self, sid: int, slot: int, context: torch.Tensor | None) -> None:
        for other in [s for s, sl in self.slot.items() if sl == slot]:  # only if the client lost track of a slot
            logger.error("slot %d reopened while stream %d still held it; dropping that stream", slot, other)
            self._fail([job for job, _ in self.queue[other]], f"its decoder slot {slot} was given to another stream")
            self._forget(other)
        self.slot[sid], self.queue[sid] = slot, deque()
        slots = torch.tensor([slot], device=self.dec.device)
        try:
            self.dec.reset(slots)
            if context is not None and len(context):
                self.dec.decode(slots, context.to(self.dec.device, torch.long)[None])
        except Exception as e:  # noqa: BLE001 - the stream's chunks report it
            logger.exception("decoding the reference codes of stream %d failed", sid)
            self.broken[sid] = f"decoding the reference codes failed: {e!r}"

    def _forget(self, sid: int) -> None:
        self.slot.pop(sid, None)
        self.queue.pop(sid, None)  # its waiting chunks were abandoned by the client
        self.broken.pop(sid, None)

    def run_round(self) -> None:
        """Decode the oldest waiting chunk of every stream: streams whose chunks have equal length together,
        shortest first (a new stream's small first chunk is its time to first audio)."""
        by_len: dict[int, list[int]] = defaultdict(list)
        for sid, q in self.queue.items():
            if q:
                by_len[q[0][1].shape[0]].append(sid)
        for _, sids in sorted(by_len.items()):
            for i in range(0, len(sids), self.max_batch):
                self._decode(sids[i:i + self.max_batch])

    def _decode(self, sids: list[int]) -> None:
        jobs = [self.queue[sid].popleft() for sid in sids]
        slots = torch.tensor([self.slot[sid] for sid in sids], device=self.dec.device)
        codes = torch.stack([c for _, c in jobs]).to(self.dec.device, torch.long)
        try:
            wav = self.batched.decode(slots, codes).float().cpu()
        except Exception as e:  # noqa: BLE001 - every stream of the batch gets the error
            logger.exception("codec decode of %d streams failed", len(sids))
            for sid in sids:  # its state misses this chunk now: later chunks would be wrong
                self.broken[sid] = f"an earlier chunk of this stream failed to decode: {e!r}"
            self._fail([job for job, _ in jobs], f"codec decode failed: {e!r}")
            return
        for (job, _), w in zip(jobs, wav):
            send(self.results, {"op": "audio", "id": job}, [w])

    def _fail(self, jobs: list[int], error: str) -> None:
        for job in jobs:
            send(self.results, {"op": "error", "id": job, "error": error})


def run_codec_worker(model_dir: str, device: str, dtype: str, addrs: dict, parent_pid: int, max_batch: int,
                     max_streams: int) -> None:
    from .worker import _die_with_parent, _wait
    _die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s codec-worker %(levelname)s %(message)s")
    ctx = zmq.Context()
    results = make_socket(ctx, zmq.PUSH, addrs["results"], bind=False)
    inbox = make_socket(ctx, zmq.PULL, addrs["inbox"], bind=False)
    from qwen_tts import Qwen3TTSTokenizer
    codec = Qwen3TTSTokenizer.from_pretrained(str(Path(model_dir) / "speech_tokenizer"), dtype=getattr(torch, dtype),
                                              device_map=device).model
    worker = CodecWorker(StreamingCodecDecoder(codec.decoder, max_streams), results, max_batch)
    freeze_startup_objects()
    log_long_pauses()
    send(results, {"op": "ready", "upsample": codec.get_decode_upsample_rate()})
    while True:
        if not worker.has_work():
            _wait(inbox, parent_pid)
        while poll(inbox, 0):  # everything that arrived meanwhile, in order
            header, tensors = recv(inbox)
            if header["op"] == "shutdown":
                return
            worker.handle(header, tensors)
        worker.run_round()


class CodecWorkerClient:
    """Starts the codec worker; opens streams on its decoder slots and hands out one future of float32
    audio per chunk."""

    def __init__(self, model_dir: str | Path, device: str, dtype: torch.dtype, max_batch: int = 64,
                 max_streams: int = 256, start_timeout_s: float = 600.0):
        self.dir = tempfile.mkdtemp(prefix="nano-qwen3tts-codec-")
        addrs = {n: f"ipc://{self.dir}/{n}" for n in ("inbox", "results")}
        self.ctx = zmq.Context()
        self.inbox = make_socket(self.ctx, zmq.PUSH, addrs["inbox"], bind=True)
        self.results = make_socket(self.ctx, zmq.PULL, addrs["results"], bind=True)
        spec = dict(model_dir=str(model_dir), device=str(device), dtype=str(dtype).removeprefix("torch."),
                    addrs=addrs, parent_pid=os.getpid(), max_batch=max_batch, max_streams=max_streams)
        self.proc = launch("nano_qwen3tts_vllm.workers.codec_worker", spec, Path(self.dir) / "codec.pkl")
        self.deadline = time.monotonic() + start_timeout_s
        self.upsample: int | None = None  # set by wait_ready()
        self.slots = SlotPool(max_streams)
        self.pending: dict[int, tuple[concurrent.futures.Future, int]] = {}  # job -> (future, stream)
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._receive, name="codec-results", daemon=True)

    def wait_ready(self) -> None:
        """Block until the worker has loaded (the constructor only launches it, so other processes can load
        meanwhile); RuntimeError if it died or timed out. Later calls return at once."""
        if self.upsample is not None:
            return
        while not poll(self.results, 200):
            if self.proc.poll() is not None or time.monotonic() > self.deadline:
                self.close()
                raise RuntimeError("the codec worker did not start (see its log above)")
        self.upsample = recv(self.results)[0]["upsample"]
        self.thread.start()

    def is_alive(self) -> bool:
        return not self.closed and self.proc.poll() is None and self.upsample is not None

    def open(self, context: torch.Tensor | None = None) -> "WorkerCodecStream":
        """Take a decoder slot (StreamsBusyError when none is free). start() sends the stream to the
        worker, with `context` [T, Q] codes (ICL reference) to decode first and drop."""
        if not self.is_alive():
            raise RuntimeError("the codec worker is not running")
        with self.lock:
            sid = next(self.ids)
        return WorkerCodecStream(self, sid, self.slots.acquire(), context)

    def _send(self, header: dict, tensors: list[torch.Tensor] | tuple = ()) -> None:
        with self.lock:  # zmq sockets are not thread-safe
            send(self.inbox, header, tensors)

    def submit(self, stream: int, frames: list[list[int]]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.is_alive():
            fut.set_exception(RuntimeError("the codec worker is not running"))
            return fut
        with self.lock:
            job = next(self.ids)
            self.pending[job] = (fut, stream)
            try:
                send(self.inbox, {"op": "decode", "id": job, "stream": stream},
                     [torch.tensor(frames, dtype=torch.int16)])
            except zmq.ZMQError as e:
                self.pending.pop(job)
                fut.set_exception(RuntimeError(f"the codec worker does not take work: {e}"))
        return fut

    def _close_stream(self, stream: "WorkerCodecStream") -> None:
        with self.lock:
            for job in [j for j, (_, sid) in self.pending.items() if sid == stream.sid]:
                self.pending.pop(job)[0].cancel()
        try:
            if stream.started and self.is_alive():
                self._send({"op": "close", "stream": stream.sid})
        except zmq.ZMQError:
            logger.warning("could not tell the codec worker that stream %d closed", stream.sid)
        # the close goes out before any later open of this slot, and the worker handles messages in order
        self.slots.release(stream.slot)

    def _receive(self) -> None:
        while not self.closed:
            if not poll(self.results, 200):
                if self.proc.poll() is not None:
                    self._fail_pending(RuntimeError(f"the codec worker died (exit code {self.proc.returncode})"))
                    return
                continue
            header, tensors = recv(self.results)
            with self.lock:
                fut, _ = self.pending.pop(header["id"], (None, None))
            if fut is None:  # its stream was closed meanwhile
                continue
            if header["op"] == "audio":
                _resolve(fut, result=tensors[0].numpy())
            else:
                _resolve(fut, error=RuntimeError(f"codec decode failed: {header['error']}"))

    def _fail_pending(self, err: Exception) -> None:
        with self.lock:
            futs, self.pending = [f for f, _ in self.pending.values()], {}
        for f in futs:
            _resolve(f, error=err)

    def close(self) -> None:
        self.closed = True
        try:
            send(self.inbox, {"op": "shutdown"})
        except zmq.ZMQError:
            pass
        try:
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
        self._fail_pending(RuntimeError("the codec worker was shut down"))
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)


def _resolve(fut: concurrent.futures.Future, result=None, error: Exception | None = None) -> None:
    try:
        fut.set_exception(error) if error is not None else fut.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled by its waiter (an asyncio task that was cancelled)
        pass


class WorkerCodecStream(CodecStream):
    def __init__(self, client: CodecWorkerClient, sid: int, slot: int, context: torch.Tensor | None):
        self.client, self.sid, self.slot, self.context = client, sid, slot, context
        self.started = self.closed = False

    def start(self) -> None:
        ctx = [] if self.context is None else [self.context.to(torch.int16)]
        self.started = True  # set first: should the send fail half-way, close() still tells the worker
        try:
            self.client._send({"op": "open", "stream": self.sid, "slot": self.slot}, ctx)
        except zmq.ZMQError as e:
            raise RuntimeError(f"the codec worker does not take work: {e}") from e

    async def astart(self) -> None:
        self.start()  # one non-blocking send

    def decode(self, frames: list[list[int]]) -> np.ndarray:
        return self.client.submit(self.sid, frames).result()

    async def adecode(self, frames: list[list[int]]) -> np.ndarray:
        return await asyncio.wrap_future(self.client.submit(self.sid, frames))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.client._close_stream(self)


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        run_codec_worker(**pickle.load(f))
