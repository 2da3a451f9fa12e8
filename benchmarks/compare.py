"""This engine against the alternatives, in one run on one GPU, on a fixed-length random checkpoint.

    python benchmarks/compare.py                       # 1.7B, 125 frames (10 s of audio), every system
    python benchmarks/compare.py --model random-0.6b-custom-voice-fixed --systems ours ours-http
    python benchmarks/compare.py --device cpu --model tiny-random-fixed --frames 10 --concurrency 1 2 4 --offline-n 4

Systems (run in this order, each one alone on the GPU):
  ours-http         `python -m nano_qwen3tts_vllm.serve` as a subprocess; concurrent httpx streaming clients
                    (POST /v1/audio/speech, pcm) spread over --client-procs processes: aggregate audio-s/s,
                    per-stream x-real-time, TTFA (first bytes)
  qwen-tts          the reference `qwen_tts.Qwen3TTSModel` (sdpa): batch 1 and batch --qwen-batch
  faster-qwen3-tts  `faster_qwen3_tts.FasterQwen3TTS` (CUDA graphs, batch 1): whole and streaming (chunk_size 8)
  ours              in-process `Qwen3TTSInterface`: batch 1, streaming, offline batch of --offline-n, and the
                    concurrency sweep with one thread per streaming request; its max_num_seqs is at least
                    --offline-n, so the offline batch runs as one wave

The checkpoint never emits EOS, so every system generates exactly --frames frames; each output's length is
checked (samples / 1920 == frames) and a system that produced anything else, or could not run, FAILS: its row
says why, and the script exits 1. No figure is reported that was not measured.

Each in-process system runs in a fresh worker process of this script (a hard --timeout-per-system, and the GPU
is fully free again afterwards); peak memory is torch.cuda.max_memory_allocated in that worker, and for every
system also the device's memory in use as nvidia-smi saw it (above the idle baseline; for ours and ours-http
that includes the KV cache reserved by --gpu-memory-utilization).

x-real-time (xRT) = seconds of audio / seconds of wall time (higher is faster). ms/frame = wall / frames,
end to end (prompt, generation and codec decode). TTFA = time to the first decoded audio.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime as dt
import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TEXT = "The quick brown fox jumps over the lazy dog, again and again, until the sun goes down."
SPEAKER, LANGUAGE = "vivian", "english"
ORDER = ["ours-http", "qwen-tts", "faster-qwen3-tts", "ours"]  # the server's process is gone before the rest
WARM_FRAMES = 8  # frames of the short warm-up calls (batches, waves)


class BenchError(Exception):
    """A measurement that cannot be made or came out wrong: the system fails, with this message."""


# ---------------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(values, q):
    import numpy as np
    return float(np.percentile(np.asarray(values, dtype=float), q))


def median(values):
    return pct(values, 50)


def r(x, nd=2):
    return None if x is None else round(float(x), nd)


def codec_facts(model_dir: str) -> tuple[int, int]:
    """(samples per frame, sample rate) from the speech tokenizer's config."""
    cfg = json.loads((Path(model_dir) / "speech_tokenizer" / "config.json").read_text())
    return int(cfg.get("decode_upsample_rate", 1920)), int(cfg.get("output_sample_rate", 24000))


def check_whole(what: str, wavs, frames: int, spf: int) -> int:
    """Every waveform must be exactly `frames` frames long; returns total samples."""
    total = 0
    for i, w in enumerate(wavs):
        n = int(len(w))
        if n != frames * spf:
            raise BenchError(f"{what}: output {i} has {n} samples = {n / spf:.2f} frames, expected exactly "
                             f"{frames} frames ({frames * spf} samples): the frame counts differ, so no figure "
                             "for it is reported")
        total += n
    return total


def check_stream(what: str, n_samples: int, frames: int, spf: int) -> None:
    """A streamed output (joined chunks) must round to `frames` frames."""
    if round(n_samples / spf) != frames:
        raise BenchError(f"{what}: streamed {n_samples} samples = {n_samples / spf:.2f} frames, expected {frames} "
                         f"frames ({frames * spf} samples)")


def git_commit() -> tuple[str, bool | None]:
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                           timeout=10)
        if c.returncode != 0:
            return "unknown", None
        d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True, timeout=10)
        return c.stdout.strip() or "unknown", bool(d.stdout.strip()) if d.returncode == 0 else None
    except Exception:
        return "unknown", None


def smi_gpu_index() -> str:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return vis if vis.isdigit() else "0"


def smi_query(field: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        c = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits",
                            "-i", smi_gpu_index()], capture_output=True, text=True, timeout=10)
        return c.stdout.strip().splitlines()[0].strip() if c.returncode == 0 and c.stdout.strip() else None
    except Exception:
        return None


class SmiMonitor:
    """Samples the device's memory in use (nvidia-smi, MiB) in a thread; peak above the idle baseline."""

    def __init__(self, enabled: bool, interval: float = 0.5):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.interval = interval
        self.baseline = self.peak = None
        self._stop = threading.Event()
        self._thread = None

    def _read(self) -> float | None:
        v = smi_query("memory.used")
        try:
            return float(v) if v is not None else None
        except ValueError:
            return None

    def __enter__(self):
        if self.enabled:
            self.baseline = self._read()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            v = self._read()
            if v is not None and (self.peak is None or v > self.peak):
                self.peak = v

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def result(self) -> dict:
        if not self.enabled:
            return {"smi_note": "nvidia-smi not available: device memory not sampled"}
        if self.peak is None or self.baseline is None:
            return {"smi_note": "nvidia-smi gave no reading"}
        return {"smi_peak_used_gib": r(self.peak / 1024), "smi_baseline_gib": r(self.baseline / 1024),
                "smi_peak_above_baseline_gib": r((self.peak - self.baseline) / 1024)}


def _child_preexec():
    """New session (so the whole process group can be killed) and die with the parent (Linux)."""
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def kill_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the child's process group, then SIGKILL what is left after `grace` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group, even if the leader is gone
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def wave_stats(recs, wave_start: float, wave_end: float, sr: int) -> dict:
    """recs: (t0, t_first, t_end, samples) per stream."""
    audio = [n / sr for _, _, _, n in recs]
    rtf = [a / (t1 - t0) for a, (t0, _, t1, _) in zip(audio, recs, strict=True)]
    ttfa = [(tf - t0) * 1000 for t0, tf, _, _ in recs]
    wall = wave_end - wave_start
    return dict(wall_s=r(wall, 3), audio_s=r(sum(audio), 2), aggregate_xrt=r(sum(audio) / wall, 1),
                per_stream_xrt_p50=r(median(rtf)), per_stream_xrt_worst=r(min(rtf)),
                ttfa_ms_p50=r(median(ttfa), 1), ttfa_ms_p95=r(pct(ttfa, 95), 1), ttfa_ms_max=r(max(ttfa), 1),
                ttfa_ms_mean=r(sum(ttfa) / len(ttfa), 1))


# ---------------------------------------------------------------------------------------------------------------
# workers (one process per in-process system)
# ---------------------------------------------------------------------------------------------------------------
class Worker:
    def __init__(self, args, system: str):
        import torch
        self.torch = torch
        self.args = args
        self.system = system
        self.cuda = args.device.startswith("cuda")
        if self.cuda and not torch.cuda.is_available():
            raise BenchError(f"--device {args.device} but torch.cuda.is_available() is False")
        self.device = args.device
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.model_dir = args._model_dir
        self.spf, self.sr = codec_facts(self.model_dir)
        self.frames = args.frames
        self.res = dict(system=system, status="running", device=args.device, dtype=str(self.dtype).split(".")[-1],
                        frames=args.frames, audio_s_per_request=r(args.frames * self.spf / self.sr, 3))
        if self.cuda:
            self.res["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
        self.save()

    def save(self) -> None:
        tmp = self.args._result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.res, f, indent=1)
        os.replace(tmp, self.args._result)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def record_peak(self) -> None:
        if self.cuda:
            self.res["torch_peak_allocated_gib"] = r(self.torch.cuda.max_memory_allocated() / 2**30)
            self.res["torch_peak_reserved_gib"] = r(self.torch.cuda.max_memory_reserved() / 2**30)

    def put(self, key: str, value) -> None:
        self.res[key] = value
        self.record_peak()
        self.save()
        log(f"{self.system}: {key} = {json.dumps(value[-1] if isinstance(value, list) else value)}")

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    # ---- qwen-tts ------------------------------------------------------------------------------------------
    def run_qwen_tts(self) -> None:
        import qwen_tts
        from qwen_tts import Qwen3TTSModel
        self.res["version"] = getattr(qwen_tts, "__version__", None) or _dist_version("qwen-tts")
        self.reset_peak()
        t = time.perf_counter()
        model = Qwen3TTSModel.from_pretrained(self.model_dir, dtype=self.dtype, device_map=self.device,
                                              attn_implementation="sdpa")
        self.put("load_s", r(time.perf_counter() - t, 1))
        kw = dict(speaker=SPEAKER, language=LANGUAGE)
        mnt = self.frames + 1  # the last sampled codebook-0 token gets no frame
        self.res["max_new_tokens"] = mnt
        B = self.args.qwen_batch
        # warm-up: short calls at both batch sizes
        model.generate_custom_voice(TEXT, max_new_tokens=WARM_FRAMES + 1, **kw)
        if B > 1:
            model.generate_custom_voice([TEXT] * B, max_new_tokens=WARM_FRAMES + 1, **kw)
        t0 = self.now()
        wavs, sr = model.generate_custom_voice(TEXT, max_new_tokens=mnt, **kw)
        wall = self.now() - t0
        check_whole("qwen-tts batch 1", wavs, self.frames, self.spf)
        audio = self.frames * self.spf / sr
        self.put("batch1", dict(wall_s=r(wall, 3), ms_per_frame=r(wall / self.frames * 1000), xrt=r(audio / wall)))
        if B > 1:
            t0 = self.now()
            wavs, sr = model.generate_custom_voice([TEXT] * B, max_new_tokens=mnt, **kw)
            wall = self.now() - t0
            total = check_whole(f"qwen-tts batch {B}", wavs, self.frames, self.spf)
            self.put("batch", dict(n=B, wall_s=r(wall, 3), aggregate_xrt=r(total / sr / wall, 1),
                                   ms_per_step=r(wall / self.frames * 1000)))
        del model
        self.free()

    # ---- faster-qwen3-tts ----------------------------------------------------------------------------------
    def run_faster(self) -> None:
        try:
            import faster_qwen3_tts
            from faster_qwen3_tts import FasterQwen3TTS
        except Exception as e:
            raise BenchError(f"faster-qwen3-tts cannot be imported ({type(e).__name__}: {e}); install "
                             "faster-qwen3-tts==0.3.2 or leave it out with --systems") from e
        ver = getattr(faster_qwen3_tts, "__version__", None)
        self.res["version"] = ver
        if ver != "0.3.2":
            log(f"faster-qwen3-tts: WARNING: version {ver}, this script was written against 0.3.2")
        self.reset_peak()
        t = time.perf_counter()
        model = FasterQwen3TTS.from_pretrained(self.model_dir, device=self.device, dtype=self.dtype,
                                               attn_implementation="sdpa")
        self.put("load_s", r(time.perf_counter() - t, 1))
        # faster-qwen3-tts's loop makes one frame per max_new_tokens (the token sampled at prefill is the first
        # frame's codebook 0), so it takes max_new_tokens=frames where qwen-tts takes frames+1. min_new_tokens=0:
        # its default 2 indexes logits[..., eos] and the fixed checkpoints set eos = vocab_size (out of range).
        mnt = self.frames
        kw = dict(speaker=SPEAKER, language=LANGUAGE, max_new_tokens=mnt, min_new_tokens=0)
        self.res["max_new_tokens"] = mnt
        self.res["min_new_tokens"] = 0
        cs = self.args.faster_chunk_size
        # warm-up (captures its CUDA graphs): one whole call, one streaming call
        wavs, sr = model.generate_custom_voice(TEXT, **kw)
        check_whole("faster-qwen3-tts warm-up", wavs, self.frames, self.spf)
        for _ in model.generate_custom_voice_streaming(TEXT, chunk_size=cs, **kw):
            pass
        walls = []
        for _ in range(self.args.repeats):
            t0 = self.now()
            wavs, sr = model.generate_custom_voice(TEXT, **kw)
            walls.append(self.now() - t0)
            check_whole("faster-qwen3-tts batch 1", wavs, self.frames, self.spf)
        wall = median(walls)
        audio = self.frames * self.spf / sr
        self.put("batch1", dict(wall_s=r(wall, 3), ms_per_frame=r(wall / self.frames * 1000), xrt=r(audio / wall),
                                repeats=len(walls)))
        ttfas, xrts = [], []
        for _ in range(self.args.repeats):
            t0 = self.now()
            first, n = None, 0
            stream = model.generate_custom_voice_streaming(TEXT, chunk_size=cs, **kw)
            for chunk, sr, _timing in stream:  # noqa: B007 (sr is used below)
                if first is None:
                    first = time.perf_counter()
                n += len(chunk)
            t1 = self.now()
            check_stream("faster-qwen3-tts streaming", n, self.frames, self.spf)
            ttfas.append((first - t0) * 1000)
            xrts.append(n / sr / (t1 - t0))
        self.put("stream", dict(chunk_size=cs, ttfa_ms_p50=r(median(ttfas), 1), ttfa_ms_all=[r(x, 1) for x in ttfas],
                                xrt=r(median(xrts)), repeats=len(ttfas)))
        del model
        self.free()

    # ---- ours (in-process API) -----------------------------------------------------------------------------
    def run_ours(self) -> None:
        from nano_qwen3tts_vllm import Qwen3TTSInterface
        a = self.args
        self.reset_peak()
        t = time.perf_counter()
        max_num_seqs = max(a.max_num_seqs, a.offline_n)  # the offline batch runs as one wave, as a user would set it
        kw = dict(device=self.device, dtype=self.dtype, max_num_seqs=max_num_seqs)
        if self.cuda:
            kw["gpu_memory_utilization"] = a.gpu_memory_utilization
        tts = Qwen3TTSInterface.from_pretrained(self.model_dir, **kw)
        try:
            self.put("load_s", r(time.perf_counter() - t, 1))
            self.res.update(max_num_seqs=max_num_seqs, gpu_memory_utilization=a.gpu_memory_utilization if self.cuda
                            else None, chunk_size=a.chunk_size, first_chunk_size=a.first_chunk_size)
            self._ours_body(tts)
        finally:
            tts.close()
        del tts
        self.free()

    def _ours_stream(self, tts, frames: int):
        """One streaming request: (t0, t_first, t_end, samples)."""
        a = self.args
        t0 = time.perf_counter()
        first, n = None, 0
        for chunk in tts.generate_custom_voice_streaming(TEXT, speaker=SPEAKER, language=LANGUAGE,
                                                         max_new_tokens=frames + 1, chunk_size=a.chunk_size,
                                                         first_chunk_size=a.first_chunk_size):
            if first is None:
                first = time.perf_counter()
            n += len(chunk)
        t1 = time.perf_counter()
        if first is None:
            raise BenchError("ours streaming: no audio at all")
        return t0, first, t1, n

    def _ours_wave(self, tts, c: int, frames: int, timeout: float):
        """c threads, each one streaming request, released together."""
        barrier = threading.Barrier(c + 1)
        recs: list = [None] * c
        errors: list = []

        def run(i):
            try:
                barrier.wait(timeout=60)
                recs[i] = self._ours_stream(tts, frames)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(c)]
        for th in threads:
            th.start()
        barrier.wait(timeout=60)
        start = time.perf_counter()
        deadline = start + timeout
        for th in threads:
            th.join(timeout=max(0.1, deadline - time.perf_counter()))
        end = self.now()
        if any(th.is_alive() for th in threads):
            raise BenchError(f"ours: concurrency {c}: streams still running after {timeout:.0f} s")
        if errors:
            raise BenchError(f"ours: concurrency {c}: {len(errors)} stream(s) failed: "
                             f"{type(errors[0]).__name__}: {errors[0]}") from errors[0]
        for i, rec in enumerate(recs):
            check_stream(f"ours concurrency {c} stream {i}", rec[3], frames, self.spf)
        return recs, start, end

    def _ours_body(self, tts) -> None:
        a, F = self.args, self.frames
        kw = dict(speaker=SPEAKER, language=LANGUAGE)
        mnt = F + 1
        self.res["max_new_tokens"] = mnt
        wave_timeout = max(60.0, a.timeout_per_system / 2)
        # warm-up: whole, streaming, a short offline batch and a short wave at the largest concurrency
        wavs, _ = tts.generate_custom_voice(TEXT, max_new_tokens=mnt, **kw)
        check_whole("ours warm-up", wavs, F, self.spf)
        self._ours_stream(tts, F)
        if a.offline_n > 0:
            tts.generate_custom_voice([TEXT] * a.offline_n, max_new_tokens=WARM_FRAMES + 1, **kw)
        sweep_at = a.concurrency if a.ours_concurrency is None else a.ours_concurrency
        if sweep_at:
            self._ours_wave(tts, max(sweep_at), WARM_FRAMES, wave_timeout)
        # batch 1, whole
        walls = []
        for _ in range(a.repeats):
            t0 = self.now()
            wavs, sr = tts.generate_custom_voice(TEXT, max_new_tokens=mnt, **kw)
            walls.append(self.now() - t0)
            check_whole("ours batch 1", wavs, F, self.spf)
        wall = median(walls)
        audio = F * self.spf / self.sr
        self.put("batch1", dict(wall_s=r(wall, 3), ms_per_frame=r(wall / F * 1000), xrt=r(audio / wall),
                                repeats=len(walls)))
        # single stream
        ttfas, xrts = [], []
        for _ in range(a.repeats):
            self.sync()
            t0, tf, _, n = self._ours_stream(tts, F)
            t1 = self.now()
            check_stream("ours streaming", n, F, self.spf)
            ttfas.append((tf - t0) * 1000)
            xrts.append(n / self.sr / (t1 - t0))
        self.put("stream", dict(chunk_size=a.chunk_size, first_chunk_size=a.first_chunk_size,
                                ttfa_ms_p50=r(median(ttfas), 1), ttfa_ms_all=[r(x, 1) for x in ttfas],
                                xrt=r(median(xrts)), repeats=len(ttfas)))
        # offline batch
        if a.offline_n > 0:
            t0 = self.now()
            try:
                wavs, sr = tts.generate_custom_voice([TEXT] * a.offline_n, max_new_tokens=mnt, **kw)
            except self.torch.OutOfMemoryError as e:
                raise BenchError(f"ours offline batch of {a.offline_n}: CUDA out of memory ({e}): lower --offline-n "
                                 "or --gpu-memory-utilization") from e
            wall = self.now() - t0
            total = check_whole(f"ours offline {a.offline_n}", wavs, F, self.spf)
            self.put("offline", dict(n=a.offline_n, wall_s=r(wall, 3), aggregate_xrt=r(total / sr / wall, 1),
                                     max_num_seqs=self.res["max_num_seqs"]))
        # concurrency sweep
        sweep = []
        for c in sweep_at:
            recs, start, end = self._ours_wave(tts, c, F, wave_timeout)
            row = dict(concurrency=c, **wave_stats(recs, start, end, self.sr))
            sweep.append(row)
            self.put("concurrency", sweep)


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def worker_main(args) -> int:
    res_path = args._result
    w = None
    try:
        w = Worker(args, args._worker)
        {"qwen-tts": w.run_qwen_tts, "faster-qwen3-tts": w.run_faster, "ours": w.run_ours}[args._worker]()
        w.record_peak()
        w.res["status"] = "ok"
        w.save()
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        traceback.print_exc()
        res = w.res if w is not None else dict(system=args._worker)
        res["status"] = "failed"
        res["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, BenchError) else str(e)
        with open(res_path, "w") as f:
            json.dump(res, f, indent=1)
        return 1


# ---------------------------------------------------------------------------------------------------------------
# parent: run a worker with a hard timeout
# ---------------------------------------------------------------------------------------------------------------
def run_worker(args, system: str, model_dir: str, tmpdir: str) -> dict:
    result = os.path.join(tmpdir, f"{system}.json")
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--_worker", system, "--_result", result,
           "--_model-dir", model_dir] + args._argv
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, preexec_fn=_child_preexec)
    timed_out = False
    try:
        proc.wait(timeout=args.timeout_per_system)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        kill_group(proc, grace=5)
    res = {}
    if os.path.exists(result):
        with contextlib.suppress(Exception):
            res = json.loads(Path(result).read_text())
    res["system"] = system
    res["elapsed_s"] = r(time.perf_counter() - t0, 1)
    if timed_out:
        res["status"] = "failed"
        res["error"] = (f"timed out after {args.timeout_per_system:.0f} s (--timeout-per-system); figures listed "
                        "for it were measured before that")
    elif proc.returncode != 0 or res.get("status") != "ok":
        res["status"] = "failed"
        res.setdefault("error", f"worker exited with code {proc.returncode} and no result")
    return res


# ---------------------------------------------------------------------------------------------------------------
# parent: ours-http (server subprocess + httpx clients)
# ---------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, n: int = 40) -> str:
    with contextlib.suppress(Exception):
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    return ""


async def http_stream(client, url: str, body: dict):
    t0 = time.perf_counter()
    first, n = None, 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread())[:500].decode(errors="replace")
            raise BenchError(f"ours-http: HTTP {resp.status_code}: {text}")
        async for b in resp.aiter_bytes():
            if b and first is None:
                first = time.perf_counter()
            n += len(b)
    t1 = time.perf_counter()
    if first is None:
        raise BenchError("ours-http: empty response")
    return t0, first, t1, n


async def http_wave(base: str, body: dict, c: int, timeout: float, start_at: float | None = None):
    import httpx
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=30.0)) as client:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        start = time.perf_counter()
        recs = await asyncio.wait_for(
            asyncio.gather(*[http_stream(client, "/v1/audio/speech", body) for _ in range(c)]), timeout)
        end = time.perf_counter()
    return recs, start, end


def _client_proc(conn, base: str) -> None:
    """A load-generator process: runs its share of each wave, sends back (t0, t_first, t_end, bytes) per stream."""
    while (msg := conn.recv()) is not None:
        body, n, start_at, timeout = msg
        try:
            conn.send(("ok", asyncio.run(http_wave(base, body, n, timeout, start_at))[0]))
        except BaseException as e:  # noqa: BLE001 - reported by the parent
            conn.send(("error", f"{type(e).__name__}: {e}"))


class ClientPool:
    """Streaming clients spread over `n` processes, started together. One Python process costs about 1 ms of
    HTTP client work per stream and chunk (measured on the CI machine), which at 64+ streams would queue in
    front of the server's own latency; real users are separate processes. time.perf_counter is
    CLOCK_MONOTONIC on Linux, so the processes' timestamps compare."""

    def __init__(self, n: int, base: str):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.base = base
        self.conns, self.procs = [], []
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_client_proc, args=(theirs, base), daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)

    def wave(self, body: dict, c: int, procs: int, timeout: float):
        """`c` streams over `procs` processes; (recs, start, end) like http_wave."""
        k = min(procs, c, len(self.conns))
        if k <= 1:
            return asyncio.run(http_wave(self.base, body, c, timeout))
        start = time.perf_counter() + 0.5  # time for every process to have its client ready
        for i, conn in enumerate(self.conns[:k]):
            conn.send((body, c // k + (i < c % k), start, timeout))
        recs = []
        for conn in self.conns[:k]:
            if not conn.poll(timeout + 10):
                raise BenchError(f"ours-http: a client process gave no result within {timeout + 10:.0f} s")
            status, out = conn.recv()
            if status != "ok":
                raise BenchError(f"ours-http: a client process failed: {out}")
            recs += out
        return recs, start, max(t1 for _, _, t1, _ in recs)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


LATENCY_SERIES = {"queue": "nano_qwen3tts_request_queue_seconds", "first_frame": "nano_qwen3tts_time_to_first_frame_seconds",
                  "first_chunk_decode": "nano_qwen3tts_first_chunk_decode_seconds",
                  "first_audio": "nano_qwen3tts_time_to_first_audio_seconds",
                  "first_byte": "nano_qwen3tts_time_to_first_byte_seconds"}


def scrape_latency(base: str) -> dict[str, float]:
    """The server's latency sums and counts (/metrics)."""
    import httpx
    want = {f"{m}_{k}" for m in LATENCY_SERIES.values() for k in ("sum", "count")}
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[name] = float(value)
    missing = want - out.keys()
    if missing:
        raise BenchError(f"ours-http: /metrics lacks {sorted(missing)}")
    return out


def latency_means(before: dict, after: dict) -> dict:
    """Mean ms per request of one wave, server side: queueing, first frame, the first chunk's codec decode, first
    audio and first bytes handed to the HTTP server (all but the decode from arrival)."""
    out = {}
    for key, m in LATENCY_SERIES.items():
        n = after[f"{m}_count"] - before[f"{m}_count"]
        out[f"server_{key}_ms_mean"] = r(1000 * (after[f"{m}_sum"] - before[f"{m}_sum"]) / n, 1) if n else None
    return out


def run_http(args, model_dir: str, tmpdir: str) -> dict:
    import httpx
    spf, sr = codec_facts(model_dir)
    F = args.frames
    cuda = args.device.startswith("cuda")
    res = dict(system="ours-http", status="running", device=args.device, frames=F, max_num_seqs=args.max_num_seqs,
               client_procs=args.client_procs,
               gpu_memory_utilization=args.gpu_memory_utilization if cuda else None, chunk_size=args.chunk_size,
               first_chunk_size=args.first_chunk_size, max_new_tokens=F + 1)
    deadline = time.perf_counter() + args.timeout_per_system
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logf = args.server_log or os.path.join(tmpdir, "server.log")
    max_c = max(args.concurrency) if args.concurrency else 1
    cmd = [sys.executable, "-m", "nano_qwen3tts_vllm.serve", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--device", args.device, "--dtype", "bfloat16" if cuda else "float32",
           "--max-num-seqs", str(args.max_num_seqs), "--max-queue", str(max(4 * args.max_num_seqs, 2 * max_c)),
           "--chunk-size", str(args.chunk_size), "--first-chunk-size", str(args.first_chunk_size),
           "--log-level", "info" if args.server_log else "warning"]
    if cuda:
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    res["server_cmd"] = " ".join(cmd[1:])
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.perf_counter()
    pool = None
    log(f"ours-http: starting the server on port {port} (log: {logf})")
    with open(logf, "w") as lf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                preexec_fn=_child_preexec)
    try:
        # wait for /health
        while True:
            if proc.poll() is not None:
                raise BenchError(f"ours-http: the server exited with code {proc.returncode} before /health was "
                                 f"ready; its log ends:\n{tail(logf)}")
            if time.perf_counter() > deadline:
                raise BenchError(f"ours-http: /health not 200 after {args.timeout_per_system:.0f} s; log ends:\n"
                                 f"{tail(logf)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        res["startup_s"] = r(time.perf_counter() - t0, 1)
        log(f"ours-http: server ready in {res['startup_s']} s")
        models = httpx.get(base + "/v1/models", timeout=10).json()
        name = models["data"][0]["id"]
        body = dict(model=name, input=TEXT, voice=SPEAKER, response_format="pcm", language=LANGUAGE,
                    max_new_tokens=F + 1)

        def remaining() -> float:
            left = deadline - time.perf_counter()
            if left < 5:
                raise BenchError(f"ours-http: out of time (--timeout-per-system {args.timeout_per_system:.0f} s)")
            return left

        pool = ClientPool(max(args.client_procs), base)
        # warm-up: one full request, one short wave at the largest concurrency
        recs, _, _ = asyncio.run(http_wave(base, body, 1, remaining()))
        check_stream("ours-http warm-up", recs[0][3] // 2, F, spf)
        if args.concurrency:
            pool.wave(dict(body, max_new_tokens=WARM_FRAMES + 1), max_c, args.client_procs[0], remaining())
        sweep = []
        for c in args.concurrency:
            for procs in dict.fromkeys(min(p, c) for p in args.client_procs):  # the headline count first
                before = scrape_latency(base)
                try:
                    recs, start, end = pool.wave(body, c, procs, remaining())
                except asyncio.TimeoutError:
                    raise BenchError(f"ours-http: concurrency {c}: streams still running at the deadline") from None
                for i, rec in enumerate(recs):
                    if rec[3] % 2:
                        raise BenchError(f"ours-http: concurrency {c} stream {i}: odd byte count {rec[3]} for s16le")
                    check_stream(f"ours-http concurrency {c} stream {i}", rec[3] // 2, F, spf)
                recs = [(a, b, c_, n // 2) for a, b, c_, n in recs]  # bytes -> samples
                row = dict(concurrency=c, client_procs=procs, **wave_stats(recs, start, end, sr),
                           **latency_means(before, scrape_latency(base)))
                sweep.append(row)
                res["concurrency"] = sweep
                log(f"ours-http: {json.dumps(row)}")
        if proc.poll() is not None:
            raise BenchError(f"ours-http: the server died during the run (code {proc.returncode}); log ends:\n"
                             f"{tail(logf)}")
        res["status"] = "ok"
    except BaseException as e:
        res["status"] = "failed"
        res["error"] = str(e) if isinstance(e, BenchError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, (BenchError, Exception)):
            raise  # KeyboardInterrupt / SystemExit: after the finally below
    finally:
        if pool is not None:
            pool.close()
        log("ours-http: stopping the server")
        kill_group(proc, grace=20)
        res["elapsed_s"] = r(time.perf_counter() - t0, 1)
        if cuda:
            res["torch_peak_note"] = "server subprocess: see smi_* (device memory in use, includes the KV cache)"
    return res


# ---------------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------------
def fmt(x, unit: str = "", nd: int | None = None) -> str:
    if x is None:
        return "-"
    if nd is not None:
        x = round(float(x), nd)
    return f"{x}{unit}"


def mem(res: dict) -> str:
    t = res.get("torch_peak_allocated_gib")
    s = res.get("smi_peak_above_baseline_gib")
    parts = []
    if t is not None:
        parts.append(f"{t}")
    if s is not None:
        parts.append(f"smi {s}")
    return " / ".join(parts) if parts else "-"


def table(report: dict) -> str:
    m = report["meta"]
    S = report["systems"]
    L = []
    dirty = "+dirty" if m.get("git_dirty") else ""
    L.append("=" * 100)
    L.append(f"compare.py  {m['date']}  {m['gpu']}  torch {m['torch']}  commit {m['git_commit']}{dirty}")
    L.append(f"model {m['model']}  {m['frames']} frames = {m['audio_s_per_request']} s audio per request  "
             f"dtype {m['dtype']}  gpu-mem-util {m['gpu_memory_utilization']}")
    L.append(f"max-num-seqs {m['max_num_seqs']} for the server, in-process at least the offline batch "
             f"({m['offline_n']})")
    L.append("xRT = audio s / wall s (higher = faster); mem GiB = torch peak alloc / nvidia-smi above idle")
    L.append("-" * 100)
    L.append(f"{'batch 1 / single stream':<34}{'ms/frame':>10}{'xRT':>8}{'TTFA ms':>10}{'stream xRT':>12}"
             f"{'load s':>8}   mem GiB")
    for name, label in (("ours", "ours (API)"), ("qwen-tts", "qwen-tts"), ("faster-qwen3-tts", "faster-qwen3-tts")):
        res = S.get(name)
        if not res or not (res.get("batch1") or res.get("stream")):
            continue  # not run, or nothing measured (its FAILED line says why)
        b, s = res.get("batch1") or {}, res.get("stream") or {}
        chunk = ""
        if s:
            chunk = f" [chunks {s['first_chunk_size']},{s['chunk_size']}]" if name == "ours" else \
                f" [chunks {s.get('chunk_size')}]"
        L.append(f"{(label + chunk):<34}{fmt(b.get('ms_per_frame')):>10}{fmt(b.get('xrt')):>8}"
                 f"{fmt(s.get('ttfa_ms_p50')):>10}{fmt(s.get('xrt')):>12}{fmt(res.get('load_s')):>8}   {mem(res)}")
    rows = []
    if (S.get("ours") or {}).get("offline"):
        o = S["ours"]["offline"]
        rows.append(f"{'ours offline generate_custom_voice':<34}{o['n']:>6}{o['aggregate_xrt']:>14}{o['wall_s']:>10}")
    if (S.get("qwen-tts") or {}).get("batch"):
        o = S["qwen-tts"]["batch"]
        rows.append(f"{'qwen-tts generate_custom_voice':<34}{o['n']:>6}{o['aggregate_xrt']:>14}{o['wall_s']:>10}")
    if rows:
        L.append("-" * 100)
        L.append(f"{'offline batch':<34}{'N':>6}{'agg xRT':>14}{'wall s':>10}")
        L += rows
    sweeps = [(n, S[n]["concurrency"]) for n in ("ours", "ours-http") if (S.get(n) or {}).get("concurrency")]
    if sweeps:
        L.append("-" * 100)
        L.append(f"{'streaming concurrency':<22}{'C':>5}{'agg xRT':>10}{'xRT p50':>10}{'xRT worst':>11}"
                 f"{'TTFA p50':>10}{'TTFA p95':>10}{'wall s':>9}")
        for n, sw in sweeps:
            for row in sw:
                label = n if is_headline(report, row) else f"{n} ({row['client_procs']} cl.)"
                L.append(f"{label:<22}{row['concurrency']:>5}{fmt(row['aggregate_xrt']):>10}"
                         f"{fmt(row['per_stream_xrt_p50']):>10}{fmt(row['per_stream_xrt_worst']):>11}"
                         f"{fmt(row['ttfa_ms_p50']):>10}{fmt(row['ttfa_ms_p95']):>10}{fmt(row['wall_s']):>9}")
        http = S.get("ours-http") or {}
        rows = [row for row in http.get("concurrency") or [] if row.get("server_first_frame_ms_mean") is not None]
        if rows:
            L.append(f"  ours-http clients in {http.get('client_procs')} process(es) (cl.); TTFA means in ms, C/cl.: "
                     "queued / first frame (engine) / first-chunk decode (codec) / first audio / first bytes sent "
                     "(server) / first bytes (client)")
            for i in range(0, len(rows), 3):
                L.append("    " + ";  ".join(
                    f"{row['concurrency']}/{row.get('client_procs', 1)}: {fmt(row['server_queue_ms_mean'])} / "
                    f"{fmt(row['server_first_frame_ms_mean'])} / {fmt(row.get('server_first_chunk_decode_ms_mean'))}"
                    f" / {fmt(row['server_first_audio_ms_mean'])} / {fmt(row.get('server_first_byte_ms_mean'))} / "
                    f"{fmt(row['ttfa_ms_mean'])}" for row in rows[i:i + 3]))
        if http.get("startup_s") is not None:
            L.append(f"  ours-http: server start {http['startup_s']} s, mem GiB {mem(http)}")
    L.append("-" * 100)
    for name in report["order"]:
        res = S[name]
        st = res.get("status")
        if st == "ok":
            L.append(f"OK      {name}  ({res.get('elapsed_s', '-')} s)")
        elif st == "skipped":
            L.append(f"SKIPPED {name}: {res.get('reason')}")
        else:
            err = [x for x in str(res.get("error", "unknown error")).splitlines() if x.strip()]
            first = err[0].removeprefix(f"{name}: ") if err else ""
            L.append(f"FAILED  {name}: {first[:300]}")
            if len(err) > 1:  # a log tail: show its exception line
                exc = [x for x in err[1:] if re.match(r"^\s*[\w.]*(Error|Exception|Interrupt)\b", x)]
                L.append(f"          ... {(exc or err)[-1].strip()[:300]}")
    L.append(f"json: {m.get('out_json')}   png: {m.get('out_png')}")
    L.append("=" * 100)
    return "\n".join(L)


def is_headline(report: dict, row: dict) -> bool:
    """In-process rows, and ours-http rows of the first --client-procs value (capped at the row's concurrency)."""
    procs = (report["systems"].get("ours-http") or {}).get("client_procs")
    return row.get("client_procs") is None or not procs or row["client_procs"] == min(procs[0], row["concurrency"])


def headline(report: dict, name: str) -> list[dict]:
    """The sweep rows a plot shows."""
    return [row for row in (report["systems"].get(name) or {}).get("concurrency") or [] if is_headline(report, row)]


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    S = report["systems"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"ours": "tab:blue", "ours-http": "tab:orange"}
    drew = False
    for n in ("ours", "ours-http"):
        sw = headline(report, n)
        if not sw:
            continue
        drew = True
        c = [row["concurrency"] for row in sw]
        ax1.plot(c, [row["aggregate_xrt"] for row in sw], "o-", color=colors[n], label=n)
        ax2.plot(c, [row["ttfa_ms_p50"] for row in sw], "o-", color=colors[n], label=f"{n} p50")
        ax2.plot(c, [row["ttfa_ms_p95"] for row in sw], "s--", color=colors[n], label=f"{n} p95")
    q = (S.get("qwen-tts") or {}).get("batch")
    if q:
        ax1.axhline(q["aggregate_xrt"], color="tab:gray", ls=":", label=f"qwen-tts batch {q['n']} (offline)")
    f = (S.get("faster-qwen3-tts") or {}).get("batch1")
    if f:
        ax1.axhline(f["xrt"], color="tab:green", ls=":", label="faster-qwen3-tts batch 1")
    fs = (S.get("faster-qwen3-tts") or {}).get("stream")
    if fs:
        ax2.axhline(fs["ttfa_ms_p50"], color="tab:green", ls=":", label=f"faster-qwen3-tts (chunk {fs['chunk_size']})")
    ticks = sorted({row["concurrency"] for n in ("ours", "ours-http")
                    for row in (S.get(n) or {}).get("concurrency") or []})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        if ticks:
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel("concurrent streaming requests")
        ax.grid(True, which="both", alpha=0.3)
        if drew or ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax1.set_ylabel("aggregate audio seconds per second")
    ax1.set_title("throughput")
    ax2.set_ylabel("time to first audio (ms)")
    ax2.set_yscale("log")
    ax2.set_title("TTFA")
    m = report["meta"]
    fig.suptitle(f"{m['model']}, {m['frames']} frames, {m['gpu']}, commit {m['git_commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random-1.7b-custom-voice-fixed",
                    help="built-in name or checkpoint dir; it must never emit EOS (a *-fixed build)")
    ap.add_argument("--frames", type=int, default=125, help="frames per request (12.5 per second of audio)")
    ap.add_argument("--systems", nargs="+", default=list(ORDER), choices=ORDER)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32, 64, 128])
    ap.add_argument("--ours-concurrency", type=int, nargs="*", default=None,
                    help="ours (in-process, one thread per stream) sweep; default: --concurrency; empty = skip")
    ap.add_argument("--offline-n", type=int, default=256, help="ours: generate_custom_voice([text] * N); 0 = skip")
    ap.add_argument("--qwen-batch", type=int, default=32, help="qwen-tts batch size for the aggregate (1 = skip)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="ours and ours-http (KV reservation)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="ours-http, and ours (at least --offline-n there) (default: max concurrency)")
    ap.add_argument("--chunk-size", type=int, default=12, help="ours streaming chunk (frames)")
    ap.add_argument("--first-chunk-size", type=int, default=3, help="ours first streaming chunk (frames)")
    ap.add_argument("--faster-chunk-size", type=int, default=8, help="faster-qwen3-tts streaming chunk (frames)")
    ap.add_argument("--repeats", type=int, default=3, help="timed batch-1 / single-stream runs (median) for ours "
                                                           "and faster-qwen3-tts; qwen-tts runs once")
    ap.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (fp32; faster-qwen3-tts is skipped)")
    ap.add_argument("--commit", default=None, help="git commit to record where the tree has no .git "
                                                   "(default: git rev-parse --short HEAD, else 'unknown')")
    ap.add_argument("--timeout-per-system", type=float, default=300.0, help="seconds; the system fails after it")
    ap.add_argument("--client-procs", type=int, nargs="+", default=[4],
                    help="ours-http: processes the streaming clients are spread over (default 4); several values "
                         "run each wave once per value, the first is the headline (table rows, plot)")
    ap.add_argument("--server-log", default=None, help="ours-http: keep the server's log here (at INFO level: "
                    "engine steps/s and per-step time every 10 s)")
    ap.add_argument("--out-json", default="benchmarks/compare.json")
    ap.add_argument("--out-png", default="benchmarks/compare.png")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    ap.add_argument("--_model-dir", dest="_model_dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args._argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    if args.frames < 1:
        ap.error("--frames must be >= 1")
    if any(c < 1 for c in args.concurrency):
        ap.error("--concurrency values must be >= 1")
    if args.offline_n < 0 or args.qwen_batch < 1 or args.repeats < 1:
        ap.error("--offline-n >= 0, --qwen-batch >= 1, --repeats >= 1")
    if any(p < 1 for p in args.client_procs):
        ap.error("--client-procs values must be >= 1")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        ap.error("--max-num-seqs must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        ap.error("--gpu-memory-utilization must be in (0, 1]")
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.concurrency) if args.concurrency else 64
    args.systems = [s for s in ORDER if s in args.systems]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        return worker_main(args)

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, on_term)

    cuda = args.device.startswith("cuda")
    import torch  # no CUDA use in this process: the GPU is the systems' alone
    from nano_qwen3tts_vllm.checkpoints import resolve_model
    commit, dirty = (args.commit, None) if args.commit else git_commit()
    gpu = (smi_query("name") or "unknown NVIDIA GPU") if cuda else "cpu"
    log(f"model {args.model}: resolving (building a full-size random checkpoint takes ~1 min the first time)")
    t = time.perf_counter()
    model_dir = os.path.abspath(resolve_model(args.model))
    if not os.path.isdir(model_dir):
        log(f"FAILED: {args.model} is not a local checkpoint or built-in name")
        return 2
    log(f"model dir {model_dir} ({time.perf_counter() - t:.1f} s)")
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    tc = cfg.get("talker_config", {})
    if tc.get("codec_eos_token_id", 0) < tc.get("vocab_size", 1 << 30):
        log(f"WARNING: {args.model} can emit EOS (codec_eos_token_id {tc.get('codec_eos_token_id')} < vocab_size "
            f"{tc.get('vocab_size')}): systems may stop early and then FAIL the frame-count check; use a *-fixed model")
    spf, sr = codec_facts(model_dir)
    out_json = os.path.abspath(args.out_json)
    out_png = os.path.abspath(args.out_png) if args.out_png else None
    report = dict(meta=dict(date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), gpu=gpu,
                            torch=torch.__version__, git_commit=commit, git_dirty=dirty, model=args.model,
                            model_dir=model_dir, frames=args.frames, audio_s_per_request=r(args.frames * spf / sr, 3),
                            samples_per_frame=spf, sample_rate=sr, device=args.device,
                            dtype="bfloat16" if cuda else "float32", text=TEXT, speaker=SPEAKER, language=LANGUAGE,
                            gpu_memory_utilization=args.gpu_memory_utilization if cuda else None,
                            max_num_seqs=args.max_num_seqs, concurrency=args.concurrency, offline_n=args.offline_n,
                            qwen_batch=args.qwen_batch, repeats=args.repeats, python=sys.version.split()[0],
                            out_json=out_json, out_png=out_png, argv=args._argv),
                  order=list(args.systems), systems={})
    failed = False
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    if out_png:
        Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    tmpdir = tempfile.mkdtemp(prefix="compare-")
    try:
        for system in args.systems:
            log(f"==== {system} ====")
            if system == "faster-qwen3-tts" and not cuda:
                reason = "needs CUDA (CUDA graphs); not run on --device cpu"
                log(f"SKIPPED faster-qwen3-tts: {reason}")
                report["systems"][system] = dict(system=system, status="skipped", reason=reason)
                continue
            with SmiMonitor(cuda) as mon:
                if system == "ours-http":
                    res = run_http(args, model_dir, tmpdir)
                else:
                    res = run_worker(args, system, model_dir, tmpdir)
            res.update(mon.result())
            report["systems"][system] = res
            if res.get("status") != "ok":
                failed = True
                log(f"FAILED {system}: {res.get('error')}")
            else:
                log(f"OK {system} in {res.get('elapsed_s')} s")
            with open(out_json, "w") as f:  # after every system, so a crash later loses nothing
                json.dump(report, f, indent=1)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    report["meta"]["gpu"] = next((res["gpu"] for res in report["systems"].values() if res.get("gpu")), gpu)
    if out_png:
        try:
            plot(report, out_png)
        except Exception as e:
            failed = True
            report["plot_error"] = f"{type(e).__name__}: {e}"
            log(f"FAILED to plot {out_png}: {e}")
            report["meta"]["out_png"] = f"(failed: {e})"
    report["status"] = "failed" if failed else "ok"
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    with open(out_json, "w") as f:
        json.dump(report, f, indent=1)
    print(table(report), flush=True)
    if failed:
        print("compare.py: FAILED (see the FAILED lines above); exit 1", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
