"""The codec (waveform) decoder in its own process, batched across streams: whatever chunk windows
are waiting when it is free are decoded in one batch. The client side resolves one future per window."""
from __future__ import annotations

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
from pathlib import Path

import torch
import zmq

from ..api.audio import DecodeWindow
from .protocol import launch, make_socket, poll, recv, send

logger = logging.getLogger(__name__)


def run_codec_worker(model_dir: str, device: str, dtype: str, addrs: dict, parent_pid: int, max_batch: int) -> None:
    from ..api.audio import decode_windows
    from .worker import _die_with_parent, _wait
    _die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s codec-worker %(levelname)s %(message)s")
    ctx = zmq.Context()
    results = make_socket(ctx, zmq.PUSH, addrs["results"], bind=False)
    inbox = make_socket(ctx, zmq.PULL, addrs["inbox"], bind=False)
    from qwen_tts import Qwen3TTSTokenizer
    codec = Qwen3TTSTokenizer.from_pretrained(str(Path(model_dir) / "speech_tokenizer"), dtype=getattr(torch, dtype),
                                              device_map=device).model
    send(results, {"op": "ready", "upsample": codec.get_decode_upsample_rate()})
    while True:
        _wait(inbox, parent_pid)
        jobs = []
        while len(jobs) < max_batch and poll(inbox, 0):
            header, tensors = recv(inbox)
            if header["op"] == "shutdown":
                return
            jobs.append((header, tensors[0]))
        windows = [DecodeWindow(codes.tolist(), h["start"], h["end"]) for h, codes in jobs]
        try:
            audio = decode_windows(codec, windows)
            for (h, _), wav in zip(jobs, audio):
                send(results, {"op": "audio", "id": h["id"]}, [torch.from_numpy(wav)])
        except Exception as e:  # noqa: BLE001 - every waiting stream gets the error
            for h, _ in jobs:
                send(results, {"op": "error", "id": h["id"], "error": repr(e)})


class CodecWorkerClient:
    """Starts the codec worker and hands out one future of float32 audio per window."""

    def __init__(self, model_dir: str | Path, device: str, dtype: torch.dtype, max_batch: int = 256,
                 start_timeout_s: float = 600.0):
        self.dir = tempfile.mkdtemp(prefix="nano-qwen3tts-codec-")
        addrs = {n: f"ipc://{self.dir}/{n}" for n in ("inbox", "results")}
        self.ctx = zmq.Context()
        self.inbox = make_socket(self.ctx, zmq.PUSH, addrs["inbox"], bind=True)
        self.results = make_socket(self.ctx, zmq.PULL, addrs["results"], bind=True)
        spec = dict(model_dir=str(model_dir), device=str(device), dtype=str(dtype).removeprefix("torch."),
                    addrs=addrs, parent_pid=os.getpid(), max_batch=max_batch)
        self.proc = launch("nano_qwen3tts_vllm.workers.codec_worker", spec, Path(self.dir) / "codec.pkl")
        deadline = time.monotonic() + start_timeout_s
        while not poll(self.results, 200):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the codec worker did not start (see its log above)")
        self.upsample = recv(self.results)[0]["upsample"]
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._receive, name="codec-results", daemon=True)
        self.thread.start()

    def is_alive(self) -> bool:
        return not self.closed and self.proc.poll() is None

    def submit(self, window: DecodeWindow) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.is_alive():
            fut.set_exception(RuntimeError("the codec worker is not running"))
            return fut
        with self.lock:  # zmq sockets are not thread-safe
            job = next(self.ids)
            self.pending[job] = fut
            try:
                send(self.inbox, {"op": "decode", "id": job, "start": window.start, "end": window.end},
                     [torch.tensor(window.codes, dtype=torch.int16)])
            except zmq.ZMQError as e:
                self.pending.pop(job)
                fut.set_exception(RuntimeError(f"the codec worker does not take work: {e}"))
        return fut

    def _receive(self) -> None:
        while not self.closed:
            if not poll(self.results, 200):
                if self.proc.poll() is not None:
                    self._fail_pending(RuntimeError(f"the codec worker died (exit code {self.proc.returncode})"))
                    return
                continue
            header, tensors = recv(self.results)
            with self.lock:
                fut = self.pending.pop(header["id"], None)
            if fut is None:
                continue
            if header["op"] == "audio":
                fut.set_result(tensors[0].numpy())
            else:
                fut.set_exception(RuntimeError(f"codec decode failed: {header['error']}"))

    def _fail_pending(self, err: Exception) -> None:
        with self.lock:
            futs, self.pending = list(self.pending.values()), {}
        for f in futs:
            f.set_exception(err)

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


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        run_codec_worker(**pickle.load(f))
