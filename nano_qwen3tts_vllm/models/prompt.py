"""Talker prompts, position by position exactly as qwen-tts `generate` builds them.

Input ids come from the qwen-tts processor: the text as
`<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n` (role = ids[:3],
text = ids[3:-5]); an instruct as `<|im_start|>user\\n{instruct}<|im_end|>\\n` (whole); an ICL
reference text as `<|im_start|>assistant\\n{ref}<|im_end|>\\n` (ids[3:-2]).
"""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..engine.sequence import Prompt


class _Rows:
    def __init__(self, groups: int):
        self.groups = groups
        self.text: list[int] = []
        self.codes: list[list[int]] = []

    def add(self, text: int = -1, codes: list[int] | None = None) -> None:
        row = [-1] * self.groups
        if codes is not None:
            row[:len(codes)] = codes
        self.text.append(text)
        self.codes.append(row)


def language_id(cfg: ModelConfig, language: str, speaker: str | None) -> int | None:
    lang = language.lower()
    lid = None if lang == "auto" else cfg.language_ids[lang]
    if lang in ("chinese", "auto") and speaker:
        dialect = cfg.speaker_dialects.get(speaker.lower(), False)
        if dialect:
            lid = cfg.language_ids[dialect]
    return lid


def build_prompt(cfg: ModelConfig, input_ids: list[int], language: str, *, speaker: str | None = None,
                 instruct_ids: list[int] | None = None, xvector: np.ndarray | None = None,
                 ref_ids: list[int] | None = None, ref_codes: np.ndarray | None = None,
                 non_streaming_mode: bool) -> Prompt:
    """One request's prefill. `speaker` is a CustomVoice speaker name; `xvector` a Base model's
    speaker embedding; `ref_ids` + `ref_codes` [T, 16] turn on in-context (ICL) cloning."""
    rows = _Rows(cfg.num_code_groups)
    for t in instruct_ids or []:
        rows.add(text=t)
    for t in input_ids[:3]:
        rows.add(text=t)

    lid = language_id(cfg, language, speaker)
    if lid is None:
        codec = [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id]
    else:
        codec = [cfg.codec_think_id, cfg.codec_think_bos_id, lid, cfg.codec_think_eos_id]
    speaker_pos = -1
    if speaker:
        codec.append(cfg.speaker_ids[speaker.lower()])
    elif xvector is not None:
        speaker_pos = len(rows.text) + len(codec)
        codec.append(-1)  # the x-vector itself is added at this position
    codec += [cfg.codec_pad_id, cfg.codec_bos_id]
    # tts_pad under all but the last two codec ids, tts_bos under codec pad; bos comes next
    for i, c in enumerate(codec[:-1]):
        rows.add(text=cfg.tts_bos_id if i == len(codec) - 2 else cfg.tts_pad_id,
                 codes=[c] if c >= 0 else None)

    text_ids = list(input_ids[3:-5])
    if ref_codes is not None:
        trailing = _icl_rows(cfg, rows, list(ref_ids[3:-2]) + text_ids, ref_codes, non_streaming_mode)
    elif non_streaming_mode:
        for t in text_ids + [cfg.tts_eos_id]:
            rows.add(text=t, codes=[cfg.codec_pad_id])
        rows.add(text=cfg.tts_pad_id, codes=[cfg.codec_bos_id])
        trailing = []
    else:
        rows.add(text=input_ids[3], codes=[cfg.codec_bos_id])
        trailing = list(input_ids[4:-5]) + [cfg.tts_eos_id]

    return Prompt(text_ids=np.array(rows.text, dtype=np.int64), codes=np.array(rows.codes, dtype=np.int64),
                  trailing_text_ids=trailing,
                  speaker=None if xvector is None else np.asarray(xvector, dtype=np.float32),
                  speaker_pos=speaker_pos)


def _icl_rows(cfg: ModelConfig, rows: _Rows, text: list[int], ref_codes: np.ndarray,
              non_streaming_mode: bool) -> list[int]:
    """Reference text + target text (then tts_eos) against codec bos + the reference frames."""
    text = text + [cfg.tts_eos_id]
    frames = [[cfg.codec_bos_id]] + [list(map(int, f)) for f in np.asarray(ref_codes)]
    if non_streaming_mode:
        for t in text:
            rows.add(text=t, codes=[cfg.codec_pad_id])
        for f in frames:
            rows.add(text=cfg.tts_pad_id, codes=f)
        return []
    for i, f in enumerate(frames):
        rows.add(text=text[i] if i < len(text) else cfg.tts_pad_id, codes=f)
    return text[len(frames):]
