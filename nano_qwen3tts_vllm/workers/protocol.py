"""Messages between the engine and its workers: a pickled header frame plus one raw frame per tensor.

Sockets are ipc:// endpoints in a private (0700) temp directory, so only this user's processes
can connect; that is what makes pickled headers acceptable here."""
from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import zmq

SEND_TIMEOUT_MS = 5000   # a send to a dead or stuck peer fails instead of blocking


def make_socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    (sock.bind if bind else sock.connect)(addr)
    return sock


def send(sock: zmq.Socket, header: dict, tensors: list[torch.Tensor | np.ndarray] | tuple = ()) -> None:
    metas, bufs = [], []
    for t in tensors:
        t = torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t.detach().contiguous().cpu()
        metas.append((str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        bufs.append(t.view(torch.uint8).numpy() if t.numel() else b"")
    sock.send_multipart([pickle.dumps(dict(header, _tensors=metas))] + bufs, copy=False)


def recv(sock: zmq.Socket) -> tuple[dict, list[torch.Tensor]]:
    frames = sock.recv_multipart()
    header = pickle.loads(frames[0])
    tensors = []
    for (dtype, shape), buf in zip(header.pop("_tensors"), frames[1:]):
        raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        tensors.append(raw.view(getattr(torch, dtype)).reshape(shape))
    return header, tensors


def poll(sock: zmq.Socket, timeout_ms: int) -> bool:
    return bool(sock.poll(timeout_ms, zmq.POLLIN))


def launch(module: str, spec: dict, spec_path: Path) -> subprocess.Popen:
    """Start `python -m module spec_path` with its arguments pickled in the private directory: a fresh
    interpreter, so nothing is inherited and the caller's script is never re-imported (as spawn would)."""
    spec_path.write_bytes(pickle.dumps(spec))
    return subprocess.Popen([sys.executable, "-m", module, str(spec_path)])
