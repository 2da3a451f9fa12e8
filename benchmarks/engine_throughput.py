"""In-process engine throughput on a full-size random checkpoint (fixed length: no early EOS).

    python benchmarks/engine_throughput.py --model random-1.7b-custom-voice-fixed --frames 125 --batches 1 8 32 64
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

FPS = 12.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random-1.7b-custom-voice-fixed")
    ap.add_argument("--frames", type=int, default=125)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--multiprocess", action="store_true", help="talker and predictor in worker processes")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--no-async-scheduling", action="store_true", help="collect each decode step before the next")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from nano_qwen3tts_vllm import Qwen3TTSInterface
    t0 = time.perf_counter()
    tts = Qwen3TTSInterface.from_pretrained(args.model, dtype=getattr(torch, args.dtype),
                                            max_num_seqs=max(args.batches), enforce_eager=args.enforce_eager,
                                            multiprocess=args.multiprocess,
                                            gpu_memory_utilization=args.gpu_memory_utilization,
                                            async_scheduling=not args.no_async_scheduling)
    print(f"load + graph capture: {time.perf_counter() - t0:.1f} s")
    kw = dict(speaker="vivian", language="english", max_new_tokens=args.frames + 1, seed=0)
    text = "The quick brown fox jumps over the lazy dog, again and again, until the sun goes down."
    tts.generate_custom_voice(text, **kw)  # warm-up
    results = []
    for bs in args.batches:
        engine = tts.engine
        torch.cuda.synchronize()
        t = time.perf_counter()
        streams = [engine.submit(job.prompt, job.params)
                   for job in tts._custom_voice_jobs([text] * bs, "vivian", "english", None, True,
                                                    dict(max_new_tokens=args.frames + 1, seed=0))]
        first = None
        frames = 0
        for i, s in enumerate(streams):
            for _ in s:
                if first is None:
                    first = time.perf_counter() - t
                frames += 1
        wall = time.perf_counter() - t
        assert frames == bs * args.frames, (frames, bs * args.frames)
        audio_s = frames / FPS
        r = dict(batch=bs, frames=frames, wall_s=round(wall, 3), ms_per_step=round(wall / args.frames * 1000, 2),
                 first_frame_ms=round(first * 1000, 1), aggregate_rtf=round(audio_s / wall, 1),
                 per_stream_rtf=round(args.frames / FPS / wall, 2))
        results.append(r)
        print(json.dumps(r))
    if not args.multiprocess:
        print(f"peak GPU memory (this process): {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    tts.close()


if __name__ == "__main__":
    main()
