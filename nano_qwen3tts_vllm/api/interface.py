"""`Qwen3TTSInterface`: the qwen-tts `Qwen3TTSModel` API on the batching engine.

Same methods, parameter names and return values `(list of float32 waveforms, sample_rate)`;
plus streaming generators and asyncio variants. One instance may be shared by many threads
and coroutines: their requests are batched together by the engine thread.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import warnings
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator

import numpy as np
import torch

from ..checkpoints import resolve_model
from ..config import EngineConfig, ModelConfig
from ..engine.engine_thread import EngineThread, RequestStream
from ..engine.llm_engine import LLMEngine
from ..engine.sequence import Prompt
from ..models.codec_decoder import CodecStream, LocalCodecStreams, StreamingCodecDecoder
from ..models.prompt import build_prompt
from ..sampling_params import SamplingParams
from .audio import ChunkPlanner, FirstChunkStats, load_audio
from .clip_pipeline import decode_while_generating

logger = logging.getLogger(__name__)
DECODE_GROUP = 16  # whole clips decoded per codec call

MAX_TEXT_CHARS = 10000
GEN_KEYS = ("do_sample", "top_k", "top_p", "temperature", "repetition_penalty", "subtalker_dosample",
            "subtalker_top_k", "subtalker_top_p", "subtalker_temperature", "max_new_tokens", "seed")

try:  # the upstream container, so prompts move freely between the two libraries
    from qwen_tts.inference.qwen3_tts_model import VoiceClonePromptItem
except Exception:  # pragma: no cover - qwen-tts is a dependency
    @dataclass
    class VoiceClonePromptItem:  # type: ignore[no-redef]
        ref_code: torch.Tensor | None
        ref_spk_embedding: torch.Tensor
        x_vector_only_mode: bool
        icl_mode: bool
        ref_text: str | None = None


@dataclass
class TTSRequest:
    """One validated request: its prompt, settings, and the reference codes ICL audio starts with."""
    prompt: Prompt
    params: SamplingParams
    ref_codes: torch.Tensor | None = None


def _as_list(x) -> list:
    return x if isinstance(x, list) else [x]


def _broadcast(name: str, values: list, n: int) -> list:
    if len(values) == 1 and n > 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"batch size mismatch: text has {n} items, {name} has {len(values)}")
    return values


def resolve_model_dir(model: str) -> Path:
    path = Path(resolve_model(model))
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(model))


@contextmanager
def _aborted_on_error(streams: list[RequestStream]) -> Iterator[None]:
    """Abort every request of `streams` if the block raises (or is cancelled)."""
    try:
        yield
    except BaseException:
        for s in streams:
            s.abort()
        raise


class Qwen3TTSInterface:
    def __init__(self, model_dir: Path, engine_thread: EngineThread, processor, speech_tokenizer,
                 speaker_encoder, generate_defaults: dict, model_cfg: ModelConfig, device, dtype, codec_worker=None,
                 max_streams: int = 256):
        self.model_dir = model_dir
        self.engine = engine_thread
        self.processor = processor
        self.speech_tokenizer = speech_tokenizer
        self.speaker_encoder = speaker_encoder
        self.generate_defaults = generate_defaults
        self.model_cfg = model_cfg
        self.device, self.dtype = device, dtype
        self.codec_worker = codec_worker  # batched streaming decode in its own process, or None (in this process)
        # streaming decode state of up to max_streams live streams (each stream holds a slot from start to end)
        self.codecs = codec_worker or LocalCodecStreams(speech_tokenizer.model.decoder, max_streams)
        # whole clips (generate_*): batched incremental decode on CUDA; the reference's decode on CPU
        self.clip_decoder = (StreamingCodecDecoder(speech_tokenizer.model.decoder, 1) if device.type == "cuda"
                             else None)
        self.clip_stream = torch.cuda.Stream(device) if self.clip_decoder is not None else None
        self.first_chunks = FirstChunkStats()

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None, engine_config: EngineConfig | None = None,
                        multiprocess: bool = False, talker_device: str | None = None,
                        predictor_device: str | None = None, codec_worker: bool | None = None,
                        max_streams: int | None = None, **engine_kwargs) -> "Qwen3TTSInterface":
        """Load a checkpoint directory, hub id, or a built-in name such as "tiny-random".

        Defaults: CUDA in bf16 when available, else CPU in fp32. Engine settings
        (max_num_seqs, max_model_len, enforce_eager, gpu_memory_utilization, ...) may be given
        as keywords or as an EngineConfig. `multiprocess=True` runs the talker and the code
        predictor in two worker processes (the serving layout), optionally on different devices,
        and (unless codec_worker=False) streaming audio decodes in a codec worker process that
        batches the chunks of all streams. `max_streams` (default 4 x max_num_seqs, the server's default
        queue) bounds the live streams, each holding decoder state; one more fails with StreamsBusyError.
        """
        from qwen_tts import Qwen3TTSTokenizer
        from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSProcessor
        from transformers import AutoConfig, AutoProcessor

        model_dir = resolve_model_dir(model)
        cfg = engine_config or EngineConfig(**engine_kwargs)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        max_streams = max_streams or 4 * cfg.max_num_seqs
        codec = None
        if multiprocess if codec_worker is None else codec_worker:
            from ..workers.codec_worker import CodecWorkerClient
            # it loads while the engine's workers do; the talker sizes its KV cache once it has (before_kv)
            codec = CodecWorkerClient(model_dir, talker_device or str(device), dtype, max_streams=max_streams)
        try:
            engine = LLMEngine(model_dir, cfg, device=device, dtype=dtype, multiprocess=multiprocess,
                               talker_device=talker_device, predictor_device=predictor_device,
                               before_kv=codec.wait_ready if codec is not None else None)
            if codec is not None:
                codec.wait_ready()  # a no-op unless the engine never sized a KV cache
        except BaseException:
            if codec is not None:
                codec.close()
            raise
        AutoConfig.register("qwen3_tts", Qwen3TTSConfig, exist_ok=True)
        AutoProcessor.register(Qwen3TTSConfig, Qwen3TTSProcessor, exist_ok=True)
        processor = AutoProcessor.from_pretrained(str(model_dir), fix_mistral_regex=True)
        speech_tokenizer = Qwen3TTSTokenizer.from_pretrained(str(model_dir / "speech_tokenizer"),
                                                             dtype=engine.dtype, device_map=str(engine.device))
        speaker_encoder = None
        if engine.model_cfg.model_type == "base":
            speaker_encoder = _load_speaker_encoder(model_dir, engine.device, engine.dtype)
        gen_path = model_dir / "generation_config.json"
        defaults = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls(model_dir, EngineThread(engine), processor, speech_tokenizer, speaker_encoder, defaults,
                   engine.model_cfg, engine.device, engine.dtype, codec, max_streams)

    def close(self) -> None:
        self.engine.shutdown()
        if self.codec_worker is not None:
            self.codec_worker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- model facts ----------------------------------------------------------------------
    def get_supported_speakers(self) -> list[str] | None:
        return sorted(self.model_cfg.speaker_ids)

    def get_supported_languages(self) -> list[str] | None:
        return sorted(self.model_cfg.supported_languages)

    # ---- the qwen-tts methods -------------------------------------------------------------
    def generate_custom_voice(self, text, speaker, language=None, instruct=None, non_streaming_mode: bool = True,
                              **kwargs) -> tuple[list[np.ndarray], int]:
        return self._run(self._custom_voice_jobs(text, speaker, language, instruct, non_streaming_mode, kwargs))

    def generate_voice_design(self, text, instruct, language=None, non_streaming_mode: bool = True,
                              **kwargs) -> tuple[list[np.ndarray], int]:
        return self._run(self._voice_design_jobs(text, instruct, language, non_streaming_mode, kwargs))

    def generate_voice_clone(self, text, language=None, ref_audio=None, ref_text=None, x_vector_only_mode=False,
                             voice_clone_prompt=None, non_streaming_mode: bool = False,
                             **kwargs) -> tuple[list[np.ndarray], int]:
        return self._run(self._voice_clone_jobs(text, language, ref_audio, ref_text, x_vector_only_mode,
                                                voice_clone_prompt, non_streaming_mode, kwargs))

    # ---- streaming ------------------------------------------------------------------------
    def generate_custom_voice_streaming(self, text: str, speaker: str, language=None, instruct=None,
                                        non_streaming_mode: bool = True, chunk_size: int = 12,
                                        first_chunk_size: int = 4, **kwargs) -> Iterator[np.ndarray]:
        """Yields float32 24 kHz audio chunks as frames are produced."""
        jobs = self._custom_voice_jobs(_one(text), speaker, language, instruct, non_streaming_mode, kwargs)
        return self._stream(jobs[0], chunk_size, first_chunk_size)

    def generate_voice_design_streaming(self, text: str, instruct: str, language=None,
                                        non_streaming_mode: bool = True, chunk_size: int = 12,
                                        first_chunk_size: int = 4, **kwargs) -> Iterator[np.ndarray]:
        jobs = self._voice_design_jobs(_one(text), instruct, language, non_streaming_mode, kwargs)
        return self._stream(jobs[0], chunk_size, first_chunk_size)

    def generate_voice_clone_streaming(self, text: str, language=None, ref_audio=None, ref_text=None,
                                       x_vector_only_mode=False, voice_clone_prompt=None,
                                       non_streaming_mode: bool = False, chunk_size: int = 12,
                                       first_chunk_size: int = 4, **kwargs) -> Iterator[np.ndarray]:
        jobs = self._voice_clone_jobs(_one(text), language, ref_audio, ref_text, x_vector_only_mode,
                                      voice_clone_prompt, non_streaming_mode, kwargs)
        return self._stream(jobs[0], chunk_size, first_chunk_size)

    # ---- one request at a time (what the server uses) ------------------------------------
    def build_request(self, task_type: str, text: str, language: str | None = None, speaker: str | None = None,
                      instruct: str | None = None, ref_audio=None, ref_text: str | None = None,
                      x_vector_only_mode: bool = False, voice_clone_prompt=None,
                      non_streaming_mode: bool | None = None, **gen) -> TTSRequest:
        """Validate and build one request; raises ValueError (nothing is queued). task_type is
        "CustomVoice", "VoiceDesign" or "Base"; non_streaming_mode defaults as upstream per task."""
        if task_type == "CustomVoice":
            nsm = True if non_streaming_mode is None else non_streaming_mode
            return self._custom_voice_jobs(_one(text), speaker, language, instruct, nsm, gen)[0]
        if task_type == "VoiceDesign":
            nsm = True if non_streaming_mode is None else non_streaming_mode
            return self._voice_design_jobs(_one(text), instruct or "", language, nsm, gen)[0]
        if task_type == "Base":
            nsm = False if non_streaming_mode is None else non_streaming_mode
            return self._voice_clone_jobs(_one(text), language, ref_audio, ref_text, x_vector_only_mode,
                                          voice_clone_prompt, nsm, gen)[0]
        raise ValueError(f"task_type must be CustomVoice, VoiceDesign or Base; got {task_type!r}")

    def stream_request(self, request: TTSRequest, chunk_size: int = 12,
                       first_chunk_size: int = 4) -> Iterator[np.ndarray]:
        return self._stream(request, chunk_size, first_chunk_size)

    def astream_request(self, request: TTSRequest, chunk_size: int = 12,
                        first_chunk_size: int = 4) -> AsyncIterator[np.ndarray]:
        """Async generator of float32 chunks; decoding runs in a worker thread, never on the event loop."""
        return self._astream(request, chunk_size, first_chunk_size)

    def stats(self) -> dict[str, float]:
        """Engine load and request latency sums (first prefill, first frame), for health checks and metrics."""
        eng = self.engine.engine
        bm = eng.scheduler.block_manager
        return dict(running=len(eng.scheduler.running), waiting=len(eng.scheduler.waiting),
                    kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks,
                    kv_usage=1 - bm.num_free_blocks / bm.num_blocks, preemptions=eng.scheduler.num_preemptions,
                    max_num_seqs=eng.cfg.max_num_seqs, codec_streams=self.codecs.slots.in_use(),
                    first_frames=eng.latency.count, queued_seconds_sum=eng.latency.queued_s,
                    first_frame_seconds_sum=eng.latency.first_frame_s, first_chunks=self.first_chunks.count,
                    first_chunk_decode_seconds_sum=self.first_chunks.decode_s,
                    codec_streams_max=self.codecs.slots.n,
                    alive=float(self.engine.is_alive() and (self.codec_worker is None or self.codec_worker.is_alive())))

    # ---- asyncio --------------------------------------------------------------------------
    async def agenerate_custom_voice(self, text, speaker, language=None, instruct=None,
                                     non_streaming_mode: bool = True, **kwargs):
        jobs = self._custom_voice_jobs(text, speaker, language, instruct, non_streaming_mode, kwargs)
        return await self._arun(jobs)

    async def agenerate_voice_design(self, text, instruct, language=None, non_streaming_mode: bool = True, **kwargs):
        return await self._arun(self._voice_design_jobs(text, instruct, language, non_streaming_mode, kwargs))

    async def agenerate_voice_clone(self, text, language=None, ref_audio=None, ref_text=None,
                                    x_vector_only_mode=False, voice_clone_prompt=None,
                                    non_streaming_mode: bool = False, **kwargs):
        jobs = await asyncio.to_thread(self._voice_clone_jobs, text, language, ref_audio, ref_text,
                                       x_vector_only_mode, voice_clone_prompt, non_streaming_mode, kwargs)
        return await self._arun(jobs)

    async def agenerate_custom_voice_streaming(self, text: str, speaker: str, language=None, instruct=None,
                                               non_streaming_mode: bool = True, chunk_size: int = 12,
                                               first_chunk_size: int = 4, **kwargs) -> AsyncIterator[np.ndarray]:
        jobs = self._custom_voice_jobs(_one(text), speaker, language, instruct, non_streaming_mode, kwargs)
        async with aclosing(self._astream(jobs[0], chunk_size, first_chunk_size)) as chunks:
            async for chunk in chunks:  # closing this generator closes that one now, not when collected
                yield chunk

    async def agenerate_voice_design_streaming(self, text: str, instruct: str, language=None,
                                               non_streaming_mode: bool = True, chunk_size: int = 12,
                                               first_chunk_size: int = 4, **kwargs) -> AsyncIterator[np.ndarray]:
        jobs = self._voice_design_jobs(_one(text), instruct, language, non_streaming_mode, kwargs)
        async with aclosing(self._astream(jobs[0], chunk_size, first_chunk_size)) as chunks:
            async for chunk in chunks:  # closing this generator closes that one now, not when collected
                yield chunk

    async def agenerate_voice_clone_streaming(self, text: str, language=None, ref_audio=None, ref_text=None,
                                              x_vector_only_mode=False, voice_clone_prompt=None,
                                              non_streaming_mode: bool = False, chunk_size: int = 12,
                                              first_chunk_size: int = 4, **kwargs) -> AsyncIterator[np.ndarray]:
        jobs = await asyncio.to_thread(self._voice_clone_jobs, _one(text), language, ref_audio, ref_text,
                                       x_vector_only_mode, voice_clone_prompt, non_streaming_mode, kwargs)
        async with aclosing(self._astream(jobs[0], chunk_size, first_chunk_size)) as chunks:
            async for chunk in chunks:  # closing this generator closes that one now, not when collected
                yield chunk

    # ---- voice-clone prompts --------------------------------------------------------------
    @torch.inference_mode()
    def create_voice_clone_prompt(self, ref_audio, ref_text=None, x_vector_only_mode=False) -> list:
        """Speaker embedding (+ reference codes for ICL) per reference; reusable across requests."""
        self._require("base", "create_voice_clone_prompt")
        audios = _as_list(ref_audio)
        texts = _broadcast("ref_text", _as_list(ref_text), len(audios))
        xvec = _broadcast("x_vector_only_mode", _as_list(x_vector_only_mode), len(audios))
        items = []
        for i, (a, rtext, xonly) in enumerate(zip(audios, texts, xvec)):
            if not xonly and not rtext:
                raise ValueError(f"ref_text is required when x_vector_only_mode=False (ICL mode); missing at index {i}")
            wav, sr = load_audio(a)
            codes = None if xonly else self.speech_tokenizer.encode(wav, sr=sr).audio_codes[0]
            items.append(VoiceClonePromptItem(ref_code=codes, ref_spk_embedding=self._speaker_embedding(wav, sr),
                                              x_vector_only_mode=bool(xonly), icl_mode=not xonly, ref_text=rtext))
        return items

    def _speaker_embedding(self, wav: np.ndarray, sr: int) -> torch.Tensor:
        import librosa
        from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram
        target = 24000
        if sr != target:
            wav = librosa.resample(y=wav.astype(np.float32), orig_sr=int(sr), target_sr=target)
        mels = mel_spectrogram(torch.from_numpy(wav).unsqueeze(0), n_fft=1024, num_mels=128, sampling_rate=target,
                               hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)
        return self.speaker_encoder(mels.to(self.device).to(self.dtype))[0]

    # ---- request building (all validation happens here, before anything is queued) -------
    def _require(self, model_type: str, method: str) -> None:
        if self.model_cfg.model_type != model_type:
            raise ValueError(f"{method} needs a {model_type} model, but {self.model_dir.name} is a "
                             f"{self.model_cfg.model_type} model")

    def _params(self, kwargs: dict) -> SamplingParams:
        unknown = set(kwargs) - set(GEN_KEYS)
        if unknown:
            logger.debug("ignoring generation arguments the engine does not use: %s", sorted(unknown))
        explicit_max = kwargs.get("max_new_tokens") is not None
        params = SamplingParams.from_defaults(self.generate_defaults, **{k: kwargs.get(k) for k in GEN_KEYS})
        params.validate(max_new_tokens_limit=self.engine.engine.max_frames if explicit_max else 10**9)
        return params

    def _fit(self, prompt: Prompt, params: SamplingParams, explicit_max: bool) -> SamplingParams:
        """Without an explicit max_new_tokens, cap the default to what fits (as vLLM does)."""
        room = self.engine.engine.max_frames - len(prompt) + 1
        if room < 2:
            raise ValueError(f"the text is too long: its prompt takes {len(prompt)} of the "
                             f"{self.engine.engine.max_frames} positions a request may use")
        if not explicit_max and params.max_new_tokens > room:
            params.max_new_tokens = room
        self.engine.engine.check_fits(prompt, params)
        return params

    def _tokenize(self, text: str) -> list[int]:
        ids = self.processor(text=text, return_tensors="pt", padding=True)["input_ids"]
        return ids.reshape(-1).tolist()

    def _texts(self, text) -> list[str]:
        texts = _as_list(text)
        for t in texts:
            if not isinstance(t, str) or not t.strip():
                raise ValueError("text must be a non-empty string")
            if len(t) > MAX_TEXT_CHARS:
                raise ValueError(f"text has {len(t)} characters; the limit is {MAX_TEXT_CHARS}")
        return texts

    def _languages(self, language, n: int) -> list[str]:
        langs = _broadcast("language", _as_list(language) if language is not None else ["Auto"], n)
        supported = set(self.model_cfg.supported_languages)
        bad = [l for l in langs if l is None or str(l).lower() not in supported]
        if bad:
            raise ValueError(f"unsupported languages: {bad}; supported: {sorted(supported)}")
        return langs

    def _job(self, text: str, language: str, kwargs: dict, non_streaming_mode: bool, **prompt_kw) -> TTSRequest:
        params = self._params(kwargs)
        input_ids = self._tokenize(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
        prompt = build_prompt(self.model_cfg, input_ids, language, non_streaming_mode=non_streaming_mode, **prompt_kw)
        return TTSRequest(prompt, self._fit(prompt, params, kwargs.get("max_new_tokens") is not None))

    def _instruct_ids(self, instruct: str | None) -> list[int] | None:
        if not instruct:
            return None
        return self._tokenize(f"<|im_start|>user\n{instruct}<|im_end|>\n")

    def _custom_voice_jobs(self, text, speaker, language, instruct, non_streaming_mode, kwargs) -> list[TTSRequest]:
        self._require("custom_voice", "generate_custom_voice")
        texts = self._texts(text)
        langs = self._languages(language, len(texts))
        speakers = _broadcast("speaker", _as_list(speaker), len(texts))
        bad = [s for s in speakers if not s or str(s).lower() not in self.model_cfg.speaker_ids]
        if bad:
            raise ValueError(f"unsupported speakers: {bad}; supported: {self.get_supported_speakers()}")
        if self.model_cfg.model_size in "0b6" and instruct:  # upstream's test, kept as is
            warnings.warn("this 0.6B CustomVoice model does not support instruct; it is ignored", stacklevel=3)
            instruct = None
        instructs = _broadcast("instruct", _as_list(instruct) if instruct is not None else [""], len(texts))
        return [self._job(t, l, kwargs, non_streaming_mode, speaker=s, instruct_ids=self._instruct_ids(i))
                for t, l, s, i in zip(texts, langs, speakers, instructs)]

    def _voice_design_jobs(self, text, instruct, language, non_streaming_mode, kwargs) -> list[TTSRequest]:
        self._require("voice_design", "generate_voice_design")
        texts = self._texts(text)
        langs = self._languages(language, len(texts))
        instructs = _broadcast("instruct", _as_list(instruct), len(texts))
        return [self._job(t, l, kwargs, non_streaming_mode, instruct_ids=self._instruct_ids(i))
                for t, l, i in zip(texts, langs, instructs)]

    def _voice_clone_jobs(self, text, language, ref_audio, ref_text, x_vector_only_mode, voice_clone_prompt,
                          non_streaming_mode, kwargs) -> list[TTSRequest]:
        self._require("base", "generate_voice_clone")
        if kwargs.get("instruct"):
            warnings.warn("Base (voice clone) models take no instruct; it is ignored", stacklevel=3)
        texts = self._texts(text)
        langs = self._languages(language, len(texts))
        if voice_clone_prompt is None:
            if ref_audio is None:
                raise ValueError("either voice_clone_prompt or ref_audio must be provided")
            items = self.create_voice_clone_prompt(ref_audio, ref_text, x_vector_only_mode)
        elif isinstance(voice_clone_prompt, dict):
            d = voice_clone_prompt
            items = [VoiceClonePromptItem(ref_code=c, ref_spk_embedding=e, x_vector_only_mode=x, icl_mode=i)
                     for c, e, x, i in zip(d["ref_code"], d["ref_spk_embedding"], d["x_vector_only_mode"],
                                           d["icl_mode"])]
            if any(it.icl_mode for it in items):
                raise ValueError("a dict voice_clone_prompt carries no ref_text, which ICL needs; pass the list "
                                 "of items from create_voice_clone_prompt instead")
        else:
            items = list(voice_clone_prompt)
        items = _broadcast("voice_clone_prompt", items, len(texts))
        jobs = []
        for t, l, it in zip(texts, langs, items):
            icl = it.icl_mode and it.ref_code is not None
            if icl and not it.ref_text:
                raise ValueError("in-context cloning needs the reference text (ref_text)")
            kw = dict(xvector=it.ref_spk_embedding.float().cpu().numpy())
            if icl:
                kw.update(ref_ids=self._tokenize(f"<|im_start|>assistant\n{it.ref_text}<|im_end|>\n"),
                          ref_codes=it.ref_code.cpu().numpy())
            job = self._job(t, l, kwargs, non_streaming_mode, **kw)
            job.ref_codes = it.ref_code.cpu() if icl else None
            jobs.append(job)
        return jobs

    # ---- running and decoding -------------------------------------------------------------
    def _submit(self, jobs: list[TTSRequest], loop=None) -> list[RequestStream]:
        streams = []
        try:
            for job in jobs:
                streams.append(self.engine.submit(job.prompt, job.params, loop=loop))
        except Exception:
            for s in streams:
                s.abort()
            raise
        return streams

    def _run(self, jobs: list[TTSRequest]) -> tuple[list[np.ndarray], int]:
        """On CUDA the clips are decoded while they are generated (clip_pipeline); elsewhere after."""
        streams = self._submit(jobs)
        with _aborted_on_error(streams):
            if self.clip_decoder is not None:
                return self._decode_while_generating(jobs, streams)
            frames = [list(s) for s in streams]
        return self._decode(jobs, frames)

    async def _arun(self, jobs: list[TTSRequest]) -> tuple[list[np.ndarray], int]:
        """_run for the event loop: decoding (while generating on CUDA) runs on a worker thread."""
        if self.clip_decoder is not None:
            streams = self._submit(jobs)
            with _aborted_on_error(streams):  # also a cancelled caller: the aborted streams end the thread's reads
                return await asyncio.to_thread(self._decode_while_generating, jobs, streams)
        streams = self._submit(jobs, loop=asyncio.get_running_loop())
        with _aborted_on_error(streams):
            frames = [[f async for f in s.aiter()] for s in streams]
        return await asyncio.to_thread(self._decode, jobs, frames)

    def _decode_while_generating(self, jobs: list[TTSRequest], streams: list) -> tuple[list[np.ndarray], int]:
        codes, wavs = decode_while_generating(self.clip_decoder, [iter(s) for s in streams],
                                              [job.ref_codes for job in jobs], self.clip_stream)
        sr = int(self.speech_tokenizer.get_output_sample_rate())
        return self._finish(jobs, codes, [w.float().cpu().numpy() for w in wavs]), sr

    def decode_codes(self, codes: list[torch.Tensor]) -> tuple[list[np.ndarray], int]:
        """Whole clips of codes [T_i, 16] -> (float32 waveforms, sample rate), as qwen-tts's speech tokenizer decodes
        them (300-frame chunks with 25 frames of context). On CUDA the batched incremental decoder (the same math,
        ~2x faster); elsewhere the reference's own decode, DECODE_GROUP clips at a time."""
        sr = int(self.speech_tokenizer.get_output_sample_rate())
        if self.clip_decoder is not None:
            return [w.float().cpu().numpy() for w in self.clip_decoder.decode_clips(codes)], sr
        wavs = []
        for i in range(0, len(codes), DECODE_GROUP):
            wavs += self.speech_tokenizer.decode([{"audio_codes": c} for c in codes[i:i + DECODE_GROUP]])[0]
        return wavs, sr

    def _decode(self, jobs: list[TTSRequest], frames: list[list[list[int]]]) -> tuple[list[np.ndarray], int]:
        """ICL audio starts with the reference codes, then is cut (as qwen-tts)."""
        codes = []
        for job, f in zip(jobs, frames):
            c = torch.tensor(f, dtype=torch.long).reshape(-1, self.model_cfg.num_code_groups)
            codes.append(c if job.ref_codes is None else torch.cat([job.ref_codes, c], dim=0))
        wavs, sr = self.decode_codes(codes)
        return self._finish(jobs, codes, wavs), sr

    def _finish(self, jobs: list[TTSRequest], codes: list[torch.Tensor], wavs: list[np.ndarray]) -> list[np.ndarray]:
        """Each job's audio from its whole clip's: ICL clips start with the reference's codes, cut (as qwen-tts)."""
        out = []
        for job, c, wav in zip(jobs, codes, wavs):
            if job.ref_codes is not None:
                cut = int(job.ref_codes.shape[0] / max(c.shape[0], 1) * wav.shape[0])
                wav = wav[cut:]
            out.append(wav)
        return out

    def _stream(self, job: TTSRequest, chunk_size: int, first_chunk_size: int) -> Iterator[np.ndarray]:
        plan = ChunkPlanner(chunk_size, first_chunk_size)
        codec = self._open_codec(job)
        stream = None
        try:
            codec.start()
            stream = self._submit([job])[0]
            for frame in stream:
                if (chunk := plan.push(frame)) is not None:
                    yield self._timed(plan, codec.decode, chunk)
            if (chunk := plan.flush()) is not None:
                yield self._timed(plan, codec.decode, chunk)
        finally:
            if stream is not None and stream.finish_reason is None:
                stream.abort()
            codec.close()

    async def _astream(self, job: TTSRequest, chunk_size: int, first_chunk_size: int) -> AsyncIterator[np.ndarray]:
        """Decoding never runs on the event loop: a worker thread, or the batched codec worker."""
        plan = ChunkPlanner(chunk_size, first_chunk_size)
        codec = self._open_codec(job)
        stream = None
        try:
            await codec.astart()
            stream = self._submit([job], loop=asyncio.get_running_loop())[0]
            async for frame in stream.aiter():
                if (chunk := plan.push(frame)) is not None:
                    yield await self._atimed(plan, codec.adecode(chunk))
            if (chunk := plan.flush()) is not None:
                yield await self._atimed(plan, codec.adecode(chunk))
        finally:
            if stream is not None and stream.finish_reason is None:
                stream.abort()
            codec.close()

    def _timed(self, plan: ChunkPlanner, decode, chunk) -> np.ndarray:
        t = time.monotonic()
        audio = decode(chunk)
        if plan.chunks == 1:
            self.first_chunks.record(time.monotonic() - t)
        return audio

    async def _atimed(self, plan: ChunkPlanner, decoding) -> np.ndarray:
        t = time.monotonic()
        audio = await decoding
        if plan.chunks == 1:
            self.first_chunks.record(time.monotonic() - t)
        return audio

    def _open_codec(self, job: TTSRequest) -> CodecStream:
        """A decoder slot for one stream (StreamsBusyError when all are taken); ICL reference codes are
        decoded first as context, and never emitted."""
        return self.codecs.open(job.ref_codes)


def _one(text) -> str:
    if isinstance(text, list):
        raise ValueError("streaming generation takes one text at a time; call it once per text")
    return text


def _load_speaker_encoder(model_dir: Path, device, dtype):
    from qwen_tts.core.models import Qwen3TTSConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder
    from ..models.loader import iter_checkpoint

    config = Qwen3TTSConfig.from_pretrained(str(model_dir))
    encoder = Qwen3TTSSpeakerEncoder(config.speaker_encoder_config)
    prefix = "speaker_encoder."
    state = {name[len(prefix):]: get() for name, get in iter_checkpoint(model_dir) if name.startswith(prefix)}
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"speaker encoder weights in {model_dir} do not match its config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return encoder.to(device=device, dtype=dtype).eval()
