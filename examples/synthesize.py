"""Synthesise a WAV file. Works offline with the built-in random checkpoints (e.g. --model tiny-random).

    python examples/synthesize.py --model tiny-random --text "Hello there." --out hello.wav
"""
from __future__ import annotations

import argparse
import logging

import soundfile as sf

from nano_qwen3tts_vllm import Qwen3TTSInterface


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random", help="checkpoint dir, hub id, or a built-in name")
    ap.add_argument("--text", default="Hello from nano-qwen3tts-vllm.")
    ap.add_argument("--speaker", default="vivian")
    ap.add_argument("--language", default="auto")
    ap.add_argument("--instruct", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default="out.wav")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    with Qwen3TTSInterface.from_pretrained(args.model) as tts:
        wavs, sr = tts.generate_custom_voice(args.text, speaker=args.speaker, language=args.language,
                                             instruct=args.instruct, max_new_tokens=args.max_new_tokens,
                                             seed=args.seed)
    sf.write(args.out, wavs[0], sr)
    logging.info("wrote %s: %.2f s at %d Hz", args.out, len(wavs[0]) / sr, sr)


if __name__ == "__main__":
    main()
