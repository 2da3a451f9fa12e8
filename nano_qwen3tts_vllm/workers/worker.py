"""The two worker processes. Per decode step the predictor turns each sequence's last talker hidden
state into a frame and sends the frame's embedding straight to the talker; the talker runs and
sends its new hidden states straight back. Only codes and codebook-0 ids go to the main process."""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback

import numpy as np
import torch
import zmq

from ..config import EngineConfig, ModelConfig
from ..engine.sequence import PENDING_C0, DecodeBatch
from ..gc_pauses import freeze_startup_objects, log_long_pauses
from .protocol import make_socket, poll, recv, send

logger = logging.getLogger(__name__)

WAIT_SLICE_MS = 1000


def _die_with_parent(parent_pid: int) -> None:
    try:  # Linux: the kernel sends SIGTERM when the parent dies, so no worker is orphaned
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _wait(sock: zmq.Socket, parent_pid: int, timeout_s: float | None = None) -> None:
    """Block until `sock` has a message; exit if the parent is gone; raise on timeout."""
    waited = 0.0
    while not poll(sock, WAIT_SLICE_MS):
        if os.getppid() != parent_pid:
            os._exit(0)
        waited += WAIT_SLICE_MS / 1000
        if timeout_s is not None and waited >= timeout_s:
            raise TimeoutError(f"no message from the other worker within {timeout_s:.0f} s")


def run_worker(role: str, model_dir: str, cfg: EngineConfig, device: str, dtype: str, addrs: dict,
               parent_pid: int, peer_timeout_s: float) -> None:
    _die_with_parent(parent_pid)
    if device == "cpu":  # two workers share the cores; spinning OpenMP pools would starve each other
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role}-worker %(levelname)s %(message)s")
    ctx = zmq.Context()
    results = make_socket(ctx, zmq.PUSH, addrs["results"], bind=False)
    inbox = make_socket(ctx, zmq.PULL, addrs[f"{role}_in"], bind=False)
    peer_in = make_socket(ctx, zmq.PULL, addrs["frames" if role == "talker" else "hidden"], bind=True)
    peer_out = make_socket(ctx, zmq.PUSH, addrs["hidden" if role == "talker" else "frames"], bind=False)
    def until_allocate() -> None:
        """The talker loads alongside the other workers, then sizes its KV cache once the engine says they have
        taken their GPU memory."""
        send(results, {"op": "loaded", "who": role})
        _wait(inbox, parent_pid)
        header, _ = recv(inbox)
        if header["op"] != "allocate":
            raise SystemExit(0)  # a shutdown: the engine's start failed elsewhere
    try:
        cls = TalkerWorker if role == "talker" else PredictorWorker
        extra = dict(before_kv=until_allocate) if role == "talker" else {}
        worker = cls(model_dir, cfg, torch.device(device), getattr(torch, dtype), peer_in, peer_out, parent_pid,
                     peer_timeout_s, **extra)
    except Exception:  # noqa: BLE001 - reported to the engine, which fails its start
        send(results, {"op": "error", "who": role, "step": 0, "error": traceback.format_exc()})
        return
    freeze_startup_objects()
    log_long_pauses()
    send(results, {"op": "ready", "who": role, "num_blocks": getattr(worker, "num_blocks", 0)})
    while True:
        _wait(inbox, parent_pid)
        header, arrays = recv(inbox)
        if header["op"] == "shutdown":
            break
        try:
            reply, tensors = worker.handle(header, [a.numpy() for a in arrays])
        except Exception:  # noqa: BLE001
            reply, tensors = {"op": "error", "who": role, "error": traceback.format_exc()}, []
        send(results, dict(reply, step=header["step"]), tensors)
    ctx.destroy(linger=0)


class TalkerWorker:
    def __init__(self, model_dir, cfg, device, dtype, frames_in, hidden_out, parent_pid, peer_timeout_s,
                 before_kv=None):
        from ..engine.talker_runner import TalkerRunner
        self.runner = TalkerRunner(ModelConfig.from_pretrained(model_dir), cfg, model_dir, device, dtype, before_kv)
        self.num_blocks = self.runner.num_blocks
        self.device = device
        self.frames_in, self.hidden_out = frames_in, hidden_out
        self.parent_pid, self.peer_timeout_s = parent_pid, peer_timeout_s

    def handle(self, msg: dict, arrays: list[np.ndarray]) -> tuple[dict, list[torch.Tensor]]:
        from ..engine.executor import prefill_and_sample
        if msg["op"] == "prefill":
            slots = [r.slot for r in msg["rows"]]
            hidden, c0 = prefill_and_sample(self.runner, msg["rows"])
            reply, tensors = {"op": "c0", "c0": c0}, []
        else:
            batch = DecodeBatch(*arrays)
            slots = batch.slots.tolist()
            self.runner.load_decode(batch)  # while the predictor is still running
            _wait(self.frames_in, self.parent_pid, self.peer_timeout_s)
            header, (frame_sum,) = recv(self.frames_in)
            if header["step"] != msg["step"]:
                raise RuntimeError(f"talker got frames of step {header['step']} for step {msg['step']}")
            hidden, c0 = self.runner.run_decode(frame_sum.to(self.device))
            reply, tensors = {"op": "c0"}, [c0]
        send(self.hidden_out, {"slots": slots}, [hidden])
        return reply, tensors


class PredictorWorker:
    def __init__(self, model_dir, cfg, device, dtype, hidden_in, frames_out, parent_pid, peer_timeout_s):
        from ..engine.predictor_runner import PredictorRunner
        model_cfg = ModelConfig.from_pretrained(model_dir)
        self.runner = PredictorRunner(model_cfg, cfg, model_dir, device, dtype)
        self.hidden = torch.zeros(cfg.max_num_seqs, model_cfg.talker.hidden_size, dtype=dtype, device=device)
        self.device = device
        self.hidden_in, self.frames_out = hidden_in, frames_out
        self.parent_pid, self.peer_timeout_s = parent_pid, peer_timeout_s

    def handle(self, msg: dict, arrays: list[np.ndarray]) -> tuple[dict, list[torch.Tensor]]:
        if msg["admit"]:
            self.runner.admit(msg["admit"])
        for _ in range(msg["sync"]):  # the talker's hidden states of every talker step since our last frame
            _wait(self.hidden_in, self.parent_pid, self.peer_timeout_s)
            header, (hidden,) = recv(self.hidden_in)
            self.hidden[header["slots"]] = hidden.to(self.device)
        batch = DecodeBatch(arrays[0], np.empty((len(arrays[0]), 0), dtype=np.int32))
        slots = torch.from_numpy(batch.slots).to(self.device)
        c0 = torch.from_numpy(np.ascontiguousarray(batch.rows[:, PENDING_C0]))
        codes, frame_sum = self.runner.run(batch, self.hidden[slots], c0)
        send(self.frames_out, {"step": msg["step"]}, [frame_sum])  # the talker starts now
        return {"op": "codes"}, [codes]


if __name__ == "__main__":  # started by MultiprocessExecutor: python -m ...workers.worker SPEC_FILE
    with open(sys.argv[1], "rb") as f:
        run_worker(**pickle.load(f))
