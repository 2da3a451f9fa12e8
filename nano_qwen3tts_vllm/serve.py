"""`nano-qwen3tts serve --model M`: load the model and serve the OpenAI-compatible speech API with uvicorn."""
from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import threading

logger = logging.getLogger("nano_qwen3tts_vllm.serve")

DTYPES = {"auto": None, "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # `nano-qwen3tts serve --model M` == `python -m nano_qwen3tts_vllm.serve --model M`
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="nano-qwen3tts serve", description="OpenAI-compatible Qwen3-TTS server.")
    p.add_argument("--model", required=True, help="checkpoint directory, hub id or built-in name (tiny-random, ...)")
    p.add_argument("--served-model-name", nargs="+", help="model name(s) clients send (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("NANO_QWEN3TTS_API_KEY"),
                   help="require 'Authorization: Bearer <key>' on /v1 routes (env NANO_QWEN3TTS_API_KEY)")
    p.add_argument("--device", help="e.g. cuda, cuda:1, cpu (default: CUDA when available)")
    p.add_argument("--talker-device", help="device of the talker (multiprocess engine)")
    p.add_argument("--predictor-device", help="device of the code predictor (multiprocess engine)")
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--voices-dir", help="where registered voices are kept (default: in memory only)")
    p.add_argument("--max-queue", type=int,
                   help="requests in flight before new ones get 429 (default: 4 x max-num-seqs); also the "
                        "number of streaming decoder slots")
    p.add_argument("--allow-remote-audio", action="store_true", help="accept http(s) URLs as ref_audio")
    p.add_argument("--allow-local-audio", action="store_true",
                   help="accept server-side paths as ref_audio (any file this process can read)")
    p.add_argument("--max-input-chars", type=int, default=4096)
    p.add_argument("--max-ref-audio-bytes", type=int, default=10 * 1024 * 1024)
    p.add_argument("--max-ref-audio-seconds", type=float, default=60.0)
    p.add_argument("--chunk-size", type=int, default=12, help="frames per streamed chunk (12 frames = 0.96 s)")
    p.add_argument("--first-chunk-size", type=int, default=3,
                   help="frames in the first chunk: small = fast first bytes")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def load_model(args: argparse.Namespace):
    import torch
    from .api.interface import Qwen3TTSInterface

    dtype = DTYPES[args.dtype]
    kw = dict(device=args.device, dtype=getattr(torch, dtype) if dtype else None)
    for name in ("max_num_seqs", "max_model_len", "gpu_memory_utilization"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.enforce_eager:
        kw["enforce_eager"] = True
    # explicit keywords of from_pretrained (the rest of its **kwargs are engine settings)
    accepted = inspect.signature(Qwen3TTSInterface.from_pretrained).parameters
    if "multiprocess" in accepted:
        kw["multiprocess"] = True
    if args.max_queue is not None and "max_streams" in accepted:  # every request in flight may be streaming
        kw["max_streams"] = args.max_queue
    for name in ("talker_device", "predictor_device"):
        if getattr(args, name) is not None:
            if name not in accepted:
                raise SystemExit(f"--{name.replace('_', '-')} needs the multiprocess engine, which this build "
                                 "does not have; use --device")
            kw[name] = getattr(args, name)
    logger.info("loading %s (%s)", args.model, kw)
    return Qwen3TTSInterface.from_pretrained(args.model, **kw)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # our own loggers at --log-level; third-party ones (transformers, qwen-tts) only from warnings up
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("nano_qwen3tts_vllm").setLevel(args.log_level.upper())
    import uvicorn
    from .gc_pauses import freeze_startup_objects, log_long_pauses
    from .server import ServerSettings, create_app

    settings = ServerSettings(
        served_model_names=args.served_model_name or [args.model], api_key=args.api_key or None,
        voices_dir=args.voices_dir, max_queue=args.max_queue, allow_remote_audio=args.allow_remote_audio,
        allow_local_audio=args.allow_local_audio, max_input_chars=args.max_input_chars,
        max_ref_audio_bytes=args.max_ref_audio_bytes, max_ref_audio_seconds=args.max_ref_audio_seconds,
        chunk_size=args.chunk_size, first_chunk_size=args.first_chunk_size)
    tts = load_model(args)
    closed = threading.Event()

    def close() -> None:
        if not closed.is_set():
            closed.set()
            tts.close()
    try:
        # uvicorn handles SIGINT/SIGTERM: it stops accepting, gives open streams 10 s, then runs the app's
        # shutdown (which closes the engine) and re-raises the signal
        app = create_app(tts, settings, on_shutdown=close)
        freeze_startup_objects()  # a full collection would stall every stream (gc_pauses)
        log_long_pauses()
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after a clean shutdown
        pass
    finally:
        close()  # startup failed, or the loop died before the app's shutdown ran


if __name__ == "__main__":
    sys.exit(main())
