"""Per-component time of one decode step (host prep, predictor, talker, bookkeeping) at a batch size.

    python benchmarks/profile_step.py --model random-1.7b-custom-voice-fixed --batch 1 --steps 50
"""
from __future__ import annotations

import argparse
import logging
import time
from collections import defaultdict

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random-1.7b-custom-voice-fixed")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--kernels", action="store_true", help="also list the top GPU kernels of the steps (torch.profiler)")
    ap.add_argument("--attention-backend", default="auto",
                    help="torch = the unfused decode path (A/B against the fused Triton kernel)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from nano_qwen3tts_vllm import Qwen3TTSInterface
    from nano_qwen3tts_vllm.engine.sequence import decode_batch
    tts = Qwen3TTSInterface.from_pretrained(args.model, max_num_seqs=max(args.batch),
                                             attention_backend=args.attention_backend,
                                             async_scheduling=False)  # the loop below drives steps one by one
    eng = tts.engine.engine
    tts.engine.shutdown()  # drive the engine directly, on this thread
    text = "The quick brown fox jumps over the lazy dog, again and again, until the sun goes down."
    for bs in args.batch:
        jobs = tts._custom_voice_jobs([text] * bs, "vivian", "english", None, True,
                                      dict(max_new_tokens=args.steps + 20, seed=0))
        for j in jobs:
            eng.add_request(j.prompt, j.params)
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()  # prefill
        torch.cuda.synchronize()
        print(f"batch {bs}: prefill {(time.perf_counter() - t) * 1000:.2f} ms "
              f"({sum(len(j.prompt) for j in jobs)} positions)")
        for _ in range(3):
            eng.step()
        acc = defaultdict(float)
        sync = torch.cuda.synchronize
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            seqs, is_prefill = eng.scheduler.schedule()
            assert not is_prefill
            ex = eng.executor
            batch = decode_batch(seqs)
            slots = torch.from_numpy(batch.slots).to(eng.device)
            hidden = ex.hidden[slots]
            sync(); t1 = time.perf_counter()
            codes, frame_sum = ex.predictor.run(batch, hidden, ex.c0[slots])
            sync(); t2 = time.perf_counter()
            frames = codes.tolist()
            for s, f in zip(seqs, frames):
                s.frames.append(f)
            t3 = time.perf_counter()
            h, c0 = ex.talker.decode(batch, frame_sum)
            sync(); t4 = time.perf_counter()
            ex.hidden[slots], ex.c0[slots] = h, c0
            for s, tok in zip(seqs, c0.tolist()):
                eng._append_c0(s, tok)
            sync(); t5 = time.perf_counter()
            for k, v in (("schedule+gather", t1 - t0), ("predictor", t2 - t1), ("frames to host", t3 - t2),
                         ("talker", t4 - t3), ("bookkeeping", t5 - t4), ("total", t5 - t0)):
                acc[k] += v
        print(f"batch {bs}: " + ", ".join(f"{k} {v / args.steps * 1000:.2f} ms" for k, v in acc.items()))
        if args.kernels:
            print_kernels(eng, bs, steps=5)
        for s in list(eng.seqs):
            eng.abort(s)


def print_kernels(eng, bs: int, steps: int) -> None:
    """GPU kernels of a few whole engine steps, by total time: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in rows)
    print(f"batch {bs}: {sum(e.count for e in rows) / steps:.0f} kernels per step, {total / steps / 1000:.2f} ms GPU")
    for e in rows[:25]:
        print(f"  {e.self_device_time_total / steps / 1000:7.3f} ms  {e.count / steps:6.0f}x  {e.key[:110]}")


if __name__ == "__main__":
    main()
