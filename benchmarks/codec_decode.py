"""Streaming codec decode: the old windowed decode against the stateful incremental one, per batch of streams.

    python benchmarks/codec_decode.py                      # CUDA, bf16, full-size codec, B 1 16 64, T 4 12
    python benchmarks/codec_decode.py --cuda-graphs        # also the incremental decode replayed as CUDA graphs
    python benchmarks/codec_decode.py --model tiny-random --device cpu --dtype float32 --iters 3
    python benchmarks/codec_decode.py --clips 256 --convs triton torch --modes   # whole clips only

Per chunk of T new frames for each of B streams:
  windowed     the reference decoder over the chunk plus `--context` (72) earlier frames, new samples kept
               (what streaming did before StreamingCodecDecoder: 84 frames decoded for 12 new at T=12)
  incremental  StreamingCodecDecoder.decode: only the T new frames, with each stream's carried state
  graph        the same call captured per (B, T) in a torch.cuda.CUDAGraph and replayed (--cuda-graphs)
  clips        --clips N: N whole clips of --clip-frames frames through decode_clips (the reference's 300/25
               chunking, batched), against the reference's own chunked decode of them in groups of 16
--convs picks the incremental decoder's convolutions: the fused Triton kernel, torch ops (unfold + matmul), or both.
One JSON line per measurement: ms per call and audio seconds decoded per second (all B streams together).
The codec is the same for every Qwen3-TTS model, so the default checkpoint's size is what matters.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SAMPLE_RATE = 24000


def load_decoder(model: str, device: str, dtype: torch.dtype):
    from qwen_tts import Qwen3TTSTokenizer
    from nano_qwen3tts_vllm.checkpoints import resolve_model
    path = Path(resolve_model(model)) / "speech_tokenizer"
    return Qwen3TTSTokenizer.from_pretrained(str(path), dtype=dtype, device_map=device).model.decoder


def timed(fn, device: str, iters: int, warmup: int) -> float:
    """Mean ms per call."""
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) / iters * 1000


def capture(dec, slots: torch.Tensor, codes: torch.Tensor, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One decode(slots, codes) as a CUDA graph: replay after writing new values into `slots` and `codes`;
    it reads and updates the state buffers in place and writes its audio into the returned tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream (cuDNN/cuBLAS pick their kernels here)
        for _ in range(3):
            dec.decode(slots, codes)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = dec.decode(slots, codes)
    return graph, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random-1.7b-custom-voice-fixed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 12], help="new frames per stream per call (T)")
    ap.add_argument("--context", type=int, default=72, help="left context frames of the windowed decode")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", nargs="*", default=["windowed", "incremental"], choices=["windowed", "incremental"])
    ap.add_argument("--convs", nargs="+", default=["auto"], choices=["auto", "triton", "torch"],
                    help="the incremental decoder's convolutions (auto: Triton on CUDA)")
    ap.add_argument("--clips", type=int, default=0, help="also decode this many whole clips (decode_clips)")
    ap.add_argument("--clip-frames", type=int, default=125)
    ap.add_argument("--profile", action="store_true", help="clips: print the top CUDA kernels of one decode_clips")
    ap.add_argument("--cuda-graphs", action="store_true", help="also time the incremental decode as CUDA graphs")
    args = ap.parse_args()
    if args.cuda_graphs and not args.device.startswith("cuda"):
        ap.error("--cuda-graphs needs --device cuda")

    ref = load_decoder(args.model, args.device, getattr(torch, args.dtype))
    if args.clips:
        clips(ref, args)
    if args.modes or args.cuda_graphs:
        for convs in args.convs:
            streams(ref, args, None if convs == "auto" else convs == "triton")


def report(args, mode: str, b: int, t: int, ms: float, up: int, **extra) -> None:
    audio_s = b * t * up / SAMPLE_RATE
    print(json.dumps(dict(mode=mode, B=b, T=t, ms=round(ms, 3), audio_s_per_s=round(audio_s / ms * 1000, 1),
                          device=args.device, dtype=args.dtype, model=args.model, **extra)), flush=True)


def clips(ref, args) -> None:
    """decode_clips per --convs against the reference's chunked decode (groups of 16), and their max difference."""
    from nano_qwen3tts_vllm.models.codec_decoder import StreamingCodecDecoder
    q, up, n, f = ref.config.num_quantizers, int(ref.total_upsample), args.clips, args.clip_frames
    gen = torch.Generator().manual_seed(1)
    codes = [torch.randint(0, 2048, (f, q), generator=gen) for _ in range(n)]
    with torch.inference_mode():
        def reference():
            return [w for i in range(0, n, 16)
                    for w in ref.chunked_decode(torch.stack(codes[i:i + 16]).transpose(1, 2).to(args.device))[:, 0]]
        expected = reference()[:4]
        report(args, "clips-reference", n, f, timed(reference, args.device, 2, 1), up)
    for convs in args.convs:
        dec = StreamingCodecDecoder(ref, max_streams=1, triton=None if convs == "auto" else convs == "triton")
        first = time.perf_counter()
        out = dec.decode_clips(codes)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        first = (time.perf_counter() - first) * 1000
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, expected))
        ms = timed(lambda: dec.decode_clips(codes), args.device, 3, 1)
        report(args, "clips", n, f, ms, up, convs=convs, first_call_ms=round(first, 1), max_abs_vs_reference=diff)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                dec.decode_clips(codes)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)


def streams(ref, args, triton: bool | None) -> None:
    from nano_qwen3tts_vllm.models.codec_decoder import StreamingCodecDecoder
    q, up = ref.config.num_quantizers, int(ref.total_upsample)
    dec = StreamingCodecDecoder(ref, max_streams=max(args.batches), triton=triton)
    convs = "triton" if dec.triton else "torch"
    pool = torch.cuda.graph_pool_handle() if args.cuda_graphs else None
    gen = torch.Generator().manual_seed(0)

    keep = []
    for b in args.batches:
        slots = torch.arange(b, device=args.device)
        for t in args.chunks:
            codes = torch.randint(0, 2048, (b, t, q), generator=gen).to(args.device)
            if "windowed" in args.modes:
                window = torch.randint(0, 2048, (b, q, args.context + t), generator=gen).to(args.device)
                with torch.inference_mode():
                    ms = timed(lambda: ref(window)[..., -t * up:], args.device, args.iters, args.warmup)
                report(args, "windowed", b, t, ms, up, frames_decoded_per_stream=args.context + t)
            if "incremental" in args.modes:
                dec.reset(slots)
                dec.decode(slots, torch.randint(0, 2048, (b, 80, q), generator=gen).to(args.device))  # past 72
                ms = timed(lambda: dec.decode(slots, codes), args.device, args.iters, args.warmup)
                report(args, "incremental", b, t, ms, up, frames_decoded_per_stream=t, convs=convs)
            if args.cuda_graphs:
                graph, out = capture(dec, slots, codes, pool)
                dec.reset(slots)
                eager = dec.decode(slots, codes).float()
                dec.reset(slots)
                graph.replay()
                diff = (out.float() - eager).abs().max().item()  # the replay must do what the eager call does
                ms = timed(graph.replay, args.device, args.iters, args.warmup)
                report(args, "graph", b, t, ms, up, frames_decoded_per_stream=t, graph_vs_eager_max_abs=diff,
                       convs=convs)
                keep.append((graph, out))  # graphs sharing a pool stay alive until the end


if __name__ == "__main__":
    main()
