"""The engine's side of the worker processes: start them with a real ready handshake, send each
step over ZMQ PUSH/PULL, wait for the results with a timeout, and restart the workers after a
failure (the engine has already failed the requests that were in flight)."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import zmq

from ..config import EngineConfig
from ..engine.sequence import DecodeBatch, PrefillRow
from .protocol import launch, make_socket, poll, recv, send

logger = logging.getLogger(__name__)

ROLES = ("talker", "predictor")


class WorkerError(RuntimeError):
    """A worker process died, failed or did not answer in time."""


class MultiprocessExecutor:
    pipelined = False  # decode rows carry each frame's c0: a step needs the one before it collected

    def __init__(self, model_dir: str | Path, cfg: EngineConfig, talker_device: torch.device,
                 predictor_device: torch.device, dtype: torch.dtype, step_timeout_s: float = 120.0,
                 start_timeout_s: float = 900.0, max_restarts: int = 3, before_kv: Callable[[], None] | None = None):
        """`before_kv` is called (in this process) before the talker sizes its KV cache: it waits for other
        processes on the GPU, such as the codec worker, to finish loading."""
        self.model_dir, self.cfg, self.dtype = str(model_dir), cfg, dtype
        self.before_kv = before_kv
        self.devices = {"talker": str(talker_device), "predictor": str(predictor_device)}
        self.step_timeout_s, self.start_timeout_s = step_timeout_s, start_timeout_s
        self.restarts_left = max_restarts
        self.procs: dict[str, subprocess.Popen] = {}
        self.broken = False
        self._start()

    # ---- life cycle -----------------------------------------------------------------------
    def _start(self) -> None:
        self.procs, self.broken = {}, False
        self.dir = tempfile.mkdtemp(prefix="nano-qwen3tts-")  # 0700: only this user can connect
        addrs = {n: f"ipc://{self.dir}/{n}" for n in ("talker_in", "predictor_in", "results", "frames", "hidden")}
        self.ctx = zmq.Context()
        try:
            self._launch(addrs)
        except BaseException:
            self._stop(graceful=False)  # no worker outlives a failed start
            raise
        logger.info("workers ready (talker on %s, predictor on %s; pids %s)", self.devices["talker"],
                    self.devices["predictor"], {r: p.pid for r, p in self.procs.items()})

    def _launch(self, addrs: dict[str, str]) -> None:
        self.results = make_socket(self.ctx, zmq.PULL, addrs["results"], bind=True)
        self.inbox = {r: make_socket(self.ctx, zmq.PUSH, addrs[f"{r}_in"], bind=True) for r in ROLES}
        dtype = str(self.dtype).removeprefix("torch.")
        deadline = time.monotonic() + self.start_timeout_s
        # both load at once; the talker then waits, because it sizes its KV cache from the memory left once the
        # predictor (and before_kv's processes) have taken theirs
        for role in ROLES:
            spec = dict(role=role, model_dir=self.model_dir, cfg=self.cfg, device=self.devices[role], dtype=dtype,
                        addrs=addrs, parent_pid=os.getpid(), peer_timeout_s=self.step_timeout_s)
            self.procs[role] = launch("nano_qwen3tts_vllm.workers.worker", spec, Path(self.dir) / f"{role}.pkl")
        self._expect(deadline, {("ready", "predictor"), ("loaded", "talker")})
        if self.before_kv is not None:
            self.before_kv()
        self._send("talker", {"op": "allocate", "step": 0})
        self.num_blocks = self._expect(deadline, {("ready", "talker")})[("ready", "talker")]["num_blocks"]
        self.step, self.unsynced, self.admitted = 0, 0, []

    def _expect(self, deadline: float, wanted: set[tuple[str, str]]) -> dict[tuple[str, str], dict]:
        """Start-up messages (op, who), in any order."""
        got = {}
        while len(got) < len(wanted):
            msg, _ = self._next(deadline, "the workers' start")
            key = (msg["op"], msg.get("who"))
            if key not in wanted:
                raise WorkerError(f"unexpected message {key} while starting the workers")
            got[key] = msg
        return got

    def _stop(self, graceful: bool) -> None:
        if graceful:
            for sock in self.inbox.values():
                try:
                    send(sock, {"op": "shutdown", "step": -1})
                except zmq.ZMQError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(timeout=10 if graceful else 0.1)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)

    def is_alive(self) -> bool:
        return not self.broken and all(p.poll() is None for p in self.procs.values())

    def recover(self) -> None:
        if self.is_alive():
            return
        if self.restarts_left <= 0:
            raise WorkerError("workers failed too often; not restarting them again")
        self.restarts_left -= 1
        logger.warning("restarting the workers (%d restarts left)", self.restarts_left)
        self._stop(graceful=False)
        self._start()
        if self.num_blocks < self.cfg.max_num_seqs:  # pragma: no cover - same config, same memory
            raise WorkerError("the restarted talker has a smaller KV cache than before")

    def shutdown(self) -> None:
        if self.procs:
            self._stop(graceful=True)
            self.procs = {}

    # ---- steps ----------------------------------------------------------------------------
    def prefill(self, rows: list[PrefillRow]) -> list[int]:
        self.step += 1
        self._send("talker", {"op": "prefill", "step": self.step, "rows": rows})
        self.unsynced += 1
        # the predictor learns the new slots' settings with its next step (without the prompt arrays)
        self.admitted += [dataclasses.replace(r, text_ids=None, codes=None, speaker=None, c0_history=None,
                                              block_table=[]) for r in rows]
        return self._collect({"c0"})["c0"][0]["c0"]

    def launch_decode(self, batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray]:
        """Runs the whole step (the predictor worker takes each frame's c0 from the rows, so the engine cannot
        launch a step before the last one is collected: see `pipelined`); the handle is the result."""
        self.step += 1
        self._send("predictor", {"op": "decode", "step": self.step, "sync": self.unsynced, "admit": self.admitted},
                   [batch.rows])
        self.unsynced, self.admitted = 0, []
        self._send("talker", {"op": "decode", "step": self.step}, [batch.rows, batch.block_tables])
        self.unsynced += 1
        got = self._collect({"codes", "c0"})
        return got["codes"][1][0].numpy(), got["c0"][1][0].numpy()

    def collect(self, handle: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """-> (codes [B, 16], next c0 [B])."""
        return handle

    def _send(self, role: str, msg: dict, arrays: list[np.ndarray] | tuple = ()) -> None:
        if not self.is_alive():
            raise WorkerError(f"the {role} worker is not running")
        try:
            send(self.inbox[role], msg, arrays)
        except zmq.Again as e:
            self.broken = True
            raise WorkerError(f"the {role} worker does not take messages") from e

    def _collect(self, ops: set[str]) -> dict[str, tuple[dict, list[torch.Tensor]]]:
        deadline = time.monotonic() + self.step_timeout_s
        got: dict[str, tuple[dict, list[torch.Tensor]]] = {}
        while len(got) < len(ops):
            msg, tensors = self._next(deadline, f"step {self.step}")
            if msg.get("step") != self.step or msg["op"] not in ops:
                self.broken = True
                raise WorkerError(f"out-of-order message {msg['op']} for step {msg.get('step')} (at {self.step})")
            got[msg["op"]] = (msg, tensors)
        return got

    def _next(self, deadline: float, what: str) -> tuple[dict, list[torch.Tensor]]:
        """The next result message; raises WorkerError if a worker died, failed, or time ran out."""
        while not poll(self.results, 100):
            dead = [r for r, p in self.procs.items() if p.poll() is not None]
            if dead:
                self.broken = True
                code = self.procs[dead[0]].returncode
                raise WorkerError(f"the {dead[0]} worker died (exit code {code}) during {what}")
            if time.monotonic() > deadline:
                self.broken = True
                raise WorkerError(f"no answer from the workers within the timeout during {what}")
        msg, tensors = recv(self.results)
        if msg["op"] == "error":
            self.broken = True
            raise WorkerError(f"the {msg['who']} worker failed during {what}:\n{msg['error']}")
        return msg, tensors
