"""Exact incremental decoding of codec frames to audio, for many streams at once.

The 12 Hz codec decoder (qwen-tts `Qwen3TTSTokenizerV2Decoder`) is causal end to end: causal convolutions,
transposed convolutions, and a transformer whose attention looks 72 frames back. So a stream can be decoded
a few frames at a time, carrying per stream only what the next frames will read: the last (kernel - 1)
inputs of every causal convolution, the last input frame(s) of every transposed convolution, and each
attention layer's keys and values of the last 71 frames. The audio then equals the one-shot decode of the
whole stream, however long, to float rounding.

`StreamingCodecDecoder` keeps that state for `max_streams` slots in preallocated buffers. `decode` gathers
the state of its slots, runs the math with the reference's own weights, and scatters the new state back:
fixed shapes for a fixed (batch, frames), no host syncs, so one call can be captured in a CUDA graph.
`decode_clips` runs the same math over whole clips, chunked as the reference's own decode chunks them.
"""
from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ..layers.triton_conv import causal_conv
from ..layers.triton_snake import snake

logger = logging.getLogger(__name__)


class StreamingCodecDecoder:
    """Incremental decoder over a loaded `Qwen3TTSTokenizerV2Decoder` (shares its weights but for the convolutions',
    which it keeps once more in the layout below).

    Activations are time-major, [B, T, C], all the way down, and nothing runs through cuDNN (whose heuristics pick
    very slow kernels for some of these shapes, and whose benchmark mode tries those kernels too). A convolution is
    one matmul over its unfolded input, or with `triton` (on CUDA), where it is faster, one implicit-GEMM kernel that
    reads the carried inputs in place and adds the residual (`layers/triton_conv`; for a 1x1 convolution it also
    applies the SnakeBeta before). A transposed convolution is a matmul and a shifted sum, the depthwise ones
    (ConvNeXt) and the final 96 -> 1 one shifted sums, a SnakeBeta one Triton kernel.

    Not thread-safe: one `decode`/`reset` at a time (`decode_clips` keeps no shared state). The slots of one call
    must be distinct.
    """

    def __init__(self, decoder: nn.Module, max_streams: int, triton: bool | None = None):
        """`triton`: convolutions through the fused Triton kernel (default: on CUDA)."""
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        p = next(decoder.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.ref, self.max_streams = decoder, max_streams
        if triton is None:  # the kernel multiplies in half precision or IEEE float32
            triton = self.device.type == "cuda" and self.dtype in (torch.float32, torch.bfloat16, torch.float16)
        self.triton = triton
        self.scratch_slot = max_streams  # one more slot: where padded rows of a CUDA-graph batch decode
        self.upsample = int(decoder.total_upsample)   # audio samples per frame
        self.num_quantizers = decoder.config.num_quantizers
        self.past = decoder.config.sliding_window - 1  # a frame attends to itself and this many before it
        tf = decoder.pre_transformer
        self.inv_freq, self.rope_scale = tf.rotary_emb.inv_freq.float(), tf.rotary_emb.attention_scaling
        self._codebooks(decoder.quantizer)
        self.shapes: dict[nn.Module, tuple[int, ...]] = {}  # per module: the shape of one stream's carried inputs
        self.weights: dict[nn.Module, torch.Tensor] = {}     # convolution weights as matmul operands
        self.snake: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for m in decoder.modules():
                self._prepare(m)
        self.state = {m: self._zeros(max_streams + 1, m) for m in self.shapes}  # [max_streams + 1, ...]
        self.pos = torch.zeros(max_streams + 1, dtype=torch.long, device=self.device)  # frames decoded per slot

    # ---- setup -----------------------------------------------------------------------------
    def _codebooks(self, q: nn.Module) -> None:
        vqs = list(q.rvq_first.vq.layers) + list(q.rvq_rest.vq.layers)
        _support(all(isinstance(vq.project_out, nn.Identity) for vq in vqs), "codebook output projections")
        books = [vq._codebook for vq in vqs]
        with torch.no_grad():
            self.books = torch.stack([b.embedding_sum / b.cluster_usage.clamp(min=b.epsilon)[:, None] for b in books])
        self.n_first = q.n_q_semantic
        self.proj_first, self.proj_rest = q.rvq_first.output_proj.weight[..., 0], q.rvq_rest.output_proj.weight[..., 0]

    def _triton_conv(self, c: nn.Conv1d) -> bool:
        """Where the Triton kernel beat unfold + cuBLAS on an H100 (benchmarks/NOTES.md, session 6): dilated
        convolutions of up to 384 channels, and 1x1 ones of up to 128 outputs, their snake fused (the kernel
        computes it per tap and per output tile: once for those)."""
        if not self.triton or c.groups != 1 or c.out_channels == 1:
            return False
        return c.in_channels <= 384 if c.kernel_size[0] > 1 else c.out_channels <= 128

    def _zeros(self, n: int, m: nn.Module) -> torch.Tensor:
        return torch.zeros(n, *self.shapes[m], dtype=self.dtype, device=self.device)

    def _prepare(self, m: nn.Module) -> None:
        name = type(m).__name__
        if name == "Qwen3TTSTokenizerV2CausalConvNet":
            _support(m.stride == 1, "strided causal convolutions")
            w = m.conv.weight  # [out, in / groups, taps]
            if self._triton_conv(m.conv):  # -> [taps, in, out], the Triton kernel's operand
                self.weights[m] = w.permute(2, 1, 0).contiguous()
            else:  # -> [out, in * taps], the order of an unfolded input
                self.weights[m] = w.reshape(w.shape[0], -1).contiguous()
            if m.kernel_size > 1:  # kernel_size is the dilated extent: the inputs carried over
                self.shapes[m] = (m.kernel_size - 1, m.conv.in_channels)
        elif name == "Qwen3TTSTokenizerV2CausalTransConvNet":
            c = m.conv
            _support(c.padding == (0,) and c.output_padding == (0,) and c.dilation == (1,) and m.left_pad == 0,
                     "padded or dilated transposed convolutions")
            _support(c.kernel_size[0] % c.stride[0] == 0 and c.groups == 1, "grouped or uneven transposed convolutions")
            w = c.weight  # [in, out, taps] -> [taps * out, in]: one matmul gives every tap's output of an input
            self.weights[m] = w.permute(2, 1, 0).reshape(-1, w.shape[0]).contiguous()
            carry = c.kernel_size[0] // c.stride[0] - 1  # earlier input frames an output frame reads
            if carry:
                self.shapes[m] = (carry, c.in_channels)
        elif name == "Qwen3TTSTokenizerV2DecoderAttention":
            _support(isinstance(m.q_norm, nn.Identity) and isinstance(m.k_norm, nn.Identity), "q/k norms")
            self.shapes[m] = (2, m.config.num_key_value_heads, self.past, m.head_dim)
        elif name == "SnakeBeta":
            self.snake[m] = (m.alpha.exp(), 1.0 / (m.beta.exp() + m.no_div_by_zero))

    # ---- public ----------------------------------------------------------------------------
    @torch.inference_mode()
    def reset(self, slots: torch.Tensor) -> None:
        """Start these slots fresh (zero history == the reference's left zero padding)."""
        for buf in self.state.values():
            buf.index_fill_(0, slots, 0)
        self.pos.index_fill_(0, slots, 0)

    @torch.inference_mode()
    def decode(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Feed T new frames `codes` [B, T, num_quantizers] to each slot in `slots` [B] (both long, on the
        decoder's device); returns their audio [B, T * upsample] and advances the slots' state."""
        if codes.dim() != 3 or codes.shape[0] != slots.shape[0] or codes.shape[2] != self.num_quantizers:
            raise ValueError(f"codes must be [B, T, {self.num_quantizers}] for B={slots.shape[0]} slots, "
                             f"got {tuple(codes.shape)}")
        st = {m: buf.index_select(0, slots) for m, buf in self.state.items()}
        pos = self.pos.index_select(0, slots)
        wav = self._forward(codes, pos, st)
        for m, buf in self.state.items():
            buf.index_copy_(0, slots, st[m])
        self.pos.index_copy_(0, slots, pos + codes.shape[1])
        return wav

    @torch.inference_mode()
    def decode_clips(self, clips: list[torch.Tensor], batch: int = 64, piece: int = 25, chunk: int = 300,
                     context: int = 25) -> list[torch.Tensor]:
        """Whole clips [T_i, num_quantizers] -> audio [T_i * upsample], as qwen-tts decodes them
        (`chunked_decode(chunk_size=300, left_context_size=25)`: chunks of 300 frames, each decoded from a fresh
        state after the 25 frames before it, whose audio is dropped). Up to `batch` clips at a time, padded at the
        end (the decoder is causal: padding never reaches a clip's own audio), fed `piece` frames per call with
        the state carried between calls: the same math, in bounded memory. Uses no slot."""
        order = sorted(range(len(clips)), key=lambda i: -len(clips[i]))  # similar lengths together: less padding
        out: list[torch.Tensor] = [torch.zeros(0, dtype=self.dtype, device=self.device)] * len(clips)
        for g in range(0, len(order), batch):
            group = order[g:g + batch]
            T = len(clips[group[0]])
            if T == 0:
                break
            codes = pad_sequence([clips[i].long().cpu() for i in group], batch_first=True).to(self.device)
            wav = self._chunked(codes, chunk, context, piece)
            for row, i in enumerate(group):
                out[i] = wav[row, :len(clips[i]) * self.upsample]
        return out

    def _chunked(self, codes: torch.Tensor, chunk: int, context: int, piece: int) -> torch.Tensor:
        T = codes.shape[1]
        clips = ClipBatch(self, codes.shape[0], chunk, context, piece)
        while (span := clips.next_piece(T)) is not None:
            clips.feed(codes[:, span[0]:span[1]])
        return clips.audio()

    # ---- the decoder, piece by piece (x is [B, T, C]) ---------------------------------------
    def _forward(self, codes: torch.Tensor, pos: torch.Tensor, st: dict) -> torch.Tensor:
        """codes [B, T, Q] after `pos` [B] frames whose carried inputs are in `st` (updated) -> audio [B, T * up]."""
        d = self.ref
        x = self._conv(self._quantize(codes), d.pre_conv, st)
        x = self._transformer(x, pos, st)
        for tconv, convnext in d.upsample:
            x = self._convnext(self._tconv(x, tconv, st), convnext, st)
        x = self._conv(x, d.decoder[0], st)
        for block in d.decoder[1:-2]:
            x = self._tconv(self._snake(x, block.block[0]), block.block[1], st)
            for unit in block.block[2:]:
                x = self._residual(x, unit, st)
        x = self._conv(x, d.decoder[-1], st, snake=d.decoder[-2])
        return x.clamp(min=-1, max=1)[..., 0]

    def _quantize(self, codes: torch.Tensor) -> torch.Tensor:
        e = self.books[torch.arange(self.num_quantizers, device=codes.device), codes]  # [B, T, Q, dim]
        first = F.linear(e[:, :, :self.n_first].sum(2), self.proj_first)
        rest = F.linear(e[:, :, self.n_first:].sum(2), self.proj_rest)
        return first + rest

    def _conv(self, x: torch.Tensor, m: nn.Module, st: dict, snake: nn.Module | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """The causal convolution m of snake(x) (if `snake`, a SnakeBeta), plus `residual` if given."""
        c, w = m.conv, self.weights[m]
        triton = w.dim() == 3  # [taps, in, out]: the Triton kernel's operand
        if snake is not None and not (triton and c.kernel_size[0] == 1):
            x, snake = self._snake(x, snake), None
        if triton:
            hist = st.get(m)
            if hist is not None:
                st[m] = _tail(hist, x)
            return causal_conv(x, hist, w, c.bias, c.dilation[0], None if snake is None else self.snake[snake],
                               residual)
        y = self._torch_conv(x, m, st)
        return y if residual is None else y + residual

    def _torch_conv(self, x: torch.Tensor, m: nn.Module, st: dict) -> torch.Tensor:
        if m in st:
            x = torch.cat([st[m], x], 1)
            st[m] = x[:, -(m.kernel_size - 1):].contiguous()  # a copy: a view would keep all of x alive
        c, w = m.conv, self.weights[m]
        taps, dil, n = c.kernel_size[0], c.dilation[0], x.shape[1] - m.kernel_size + 1
        if taps == 1:
            return F.linear(x, w, c.bias)
        if c.groups == c.in_channels == c.out_channels:  # depthwise (ConvNeXt, at 25-50 Hz): a shifted sum
            w = w.view(-1, taps)
            return sum(x[:, j * dil:j * dil + n] * w[:, j] for j in range(taps)) + c.bias
        if c.out_channels == 1:  # the last layer: one matmul over the input, then a shifted sum over the taps
            u = F.linear(x, w.view(-1, taps).t())  # [B, T + extent - 1, taps]
            return (sum(u[:, j * dil:j * dil + n, j] for j in range(taps)) + c.bias)[..., None]
        # no cuDNN: its heuristics pick ~1000x too slow kernels for some of these shapes in this layout. The
        # taps of every output position side by side ([B, n, in, taps], one copy), then one matmul.
        cols = x.unfold(1, m.kernel_size, 1)[..., ::dil]
        return F.linear(cols.reshape(x.shape[0], n, -1), w, c.bias)

    def _tconv(self, x: torch.Tensor, m: nn.Module, st: dict) -> torch.Tensor:
        """Transposed convolution with stride s and taps = q * s: each input frame's taps are one matmul row; an
        output frame's s samples sum tap groups 0..q-1 of the input frame at its position and the q-1 before."""
        c, n, B = m.conv, x.shape[1], x.shape[0]
        s, carry = c.stride[0], 0
        if m in st:
            carry = st[m].shape[1]
            x = torch.cat([st[m], x], 1)
            st[m] = x[:, -carry:].contiguous()
        z = F.linear(x, self.weights[m]).view(B, carry + n, carry + 1, s, c.out_channels)
        y = sum(z[:, carry - j:carry - j + n, j] for j in range(carry + 1)) + c.bias  # [B, n, s, out]
        return y.reshape(B, n * s, c.out_channels)

    def _snake(self, x: torch.Tensor, m: nn.Module) -> torch.Tensor:
        alpha, inv_beta = self.snake[m]
        return snake(x, alpha, inv_beta)

    def _residual(self, x: torch.Tensor, m: nn.Module, st: dict) -> torch.Tensor:
        h = self._conv(x, m.conv1, st, snake=m.act1)
        return self._conv(h, m.conv2, st, snake=m.act2, residual=x)

    def _convnext(self, x: torch.Tensor, m: nn.Module, st: dict) -> torch.Tensor:
        h = self._conv(x, m.dwconv, st)
        h = F.layer_norm(h, m.norm.normalized_shape, m.norm.weight, m.norm.bias, m.norm.eps)
        h = F.gelu(F.linear(h, m.pwconv1.weight, m.pwconv1.bias), approximate=m.act.approximate)
        h = m.gamma * F.linear(h, m.pwconv2.weight, m.pwconv2.bias)
        return x + h

    def _transformer(self, x: torch.Tensor, pos: torch.Tensor, st: dict) -> torch.Tensor:
        """x [B, T, latent] -> [B, T, latent]; pos [B]: frames each slot has decoded before."""
        tf = self.ref.pre_transformer
        h = F.linear(x, tf.input_proj.weight, tf.input_proj.bias)
        steps = torch.arange(x.shape[1], device=x.device)
        cos, sin = self._rope(pos[:, None] + steps, h.dtype)
        # key j of [past..., new...] is frame pos - past + j: inside the window, causal, and not before frame 0
        keys = torch.arange(self.past + x.shape[1], device=x.device)
        mask = (keys >= steps[:, None]) & (keys <= steps[:, None] + self.past)
        mask = (mask & (keys >= self.past - pos[:, None, None]))[:, None]  # [B, 1, T, past + T]
        for layer in tf.layers:
            a = self._attention(_rms_norm(h, layer.input_layernorm), layer.self_attn, cos, sin, mask, st)
            h = h + layer.self_attn_layer_scale.scale * a
            mlp = layer.mlp
            g = _rms_norm(h, layer.post_attention_layernorm)
            g = F.linear(mlp.act_fn(F.linear(g, mlp.gate_proj.weight)) * F.linear(g, mlp.up_proj.weight),
                         mlp.down_proj.weight)
            h = h + layer.mlp_layer_scale.scale * g
        return F.linear(_rms_norm(h, tf.norm), tf.output_proj.weight, tf.output_proj.bias)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)[:, None]  # [B, 1, T, head_dim]
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def _attention(self, x: torch.Tensor, m: nn.Module, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                   st: dict) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return F.linear(x, proj.weight, proj.bias).view(b, t, -1, m.head_dim).transpose(1, 2)
        q, k, v = heads(m.q_proj), heads(m.k_proj), heads(m.v_proj)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = torch.cat([st[m][:, 0], k], 2), torch.cat([st[m][:, 1], v], 2)
        st[m] = torch.stack([k[:, :, t:], v[:, :, t:]], 1)
        if m.num_key_value_groups > 1:
            k, v = k.repeat_interleave(m.num_key_value_groups, 1), v.repeat_interleave(m.num_key_value_groups, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=m.scaling)
        return F.linear(o.transpose(1, 2).reshape(b, t, -1), m.o_proj.weight, m.o_proj.bias)


class ClipBatch:
    """B whole clips through a decoder as qwen-tts's chunked_decode cuts them (chunks of `chunk` frames, each decoded
    from a fresh state after the `context` frames before it, whose audio is dropped), `piece` frames per call. The
    caller feeds each piece when it has its frames: all at once (decode_clips), or while the clips are generated."""

    def __init__(self, dec: StreamingCodecDecoder, B: int, chunk: int = 300, context: int = 25, piece: int = 25):
        self.dec, self.B, self.chunk, self.context, self.piece = dec, B, chunk, context, piece
        self.start = self.ctx = self.s = 0  # the current chunk's first frame, its context frames, the next frame
        self.pieces: list[torch.Tensor] = []
        self.wavs: list[torch.Tensor] = []
        self._fresh()

    def _fresh(self) -> None:
        self.st = {m: self.dec._zeros(self.B, m) for m in self.dec.shapes}
        self.pos = torch.zeros(self.B, dtype=torch.long, device=self.dec.device)

    def next_piece(self, total: int | None = None) -> tuple[int, int] | None:
        """Frames [s, e) to feed next; `total`: the clips' length once known (None while they grow); None: done."""
        if total is not None and self.start < total <= self.s:  # fed to the end before the end was known
            self._close_chunk()
        if total is not None and self.start >= total:
            return None
        e = min(self.s + self.piece, self.start + self.chunk)
        return self.s, e if total is None else min(e, total)

    @torch.inference_mode()
    def feed(self, codes: torch.Tensor) -> None:
        """Decode the piece next_piece() named, codes [B, e - s, Q]."""
        self.pieces.append(self.dec._forward(codes, self.pos, self.st))
        self.pos, self.s = self.pos + codes.shape[1], self.s + codes.shape[1]
        if self.s == self.start + self.chunk:
            self._close_chunk()

    def _close_chunk(self) -> None:
        self.wavs.append(torch.cat(self.pieces, 1)[:, self.ctx * self.dec.upsample:])
        self.pieces = []
        self.start += self.chunk
        self.ctx = self.context if self.start - self.context > 0 else self.start  # as the reference
        self.s = self.start - self.ctx
        self._fresh()

    def audio(self) -> torch.Tensor:
        """[B, frames fed * upsample]: every chunk's audio so far, context dropped."""
        if not self.wavs:
            return torch.zeros(self.B, 0, dtype=self.dec.dtype, device=self.dec.device)
        return torch.cat(self.wavs, 1)


class CodecGraphs:
    """A streaming codec decoder's decode(slots, codes) through CUDA graphs, one per (batch bucket,
    frames): the eager decode of a few frames is hundreds of small launches. Padded rows decode into
    the decoder's scratch slot. Chunks of `frames` frames are captured up front (a capture in the middle of
    serving stalls every stream); `lazy` also captures any other shape on first use, which is only safe where
    no other thread uses the GPU meanwhile (the codec worker); otherwise other shapes run eagerly."""
    MAX_FRAMES = 32   # longer chunks (rare: ICL context) run eagerly

    def __init__(self, decoder: StreamingCodecDecoder, max_batch: int = 64, lazy: bool = True,
                 frames: range = range(1, 17)):
        self.dec, self.lazy = decoder, lazy
        self.sizes = [b for b in (1, 2, 4, 8, 16, 32, 48, 64) if b < max_batch] + [max_batch]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            for t in reversed(frames):
                self.graphs[b, t] = self._capture(b, t)
        logger.info("captured %d codec decode graphs", len(self.graphs))

    def decode(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        B, T = codes.shape[:2]
        if T > self.MAX_FRAMES or B > self.sizes[-1]:
            return self.dec.decode(slots, codes)
        key = (next(s for s in self.sizes if s >= B), T)
        if key not in self.graphs:
            if not self.lazy:
                return self.dec.decode(slots, codes)
            self.graphs[key] = self._capture(*key)
            logger.info("captured the codec decode graph for %d streams x %d frames", *key)
        graph, s_slots, s_codes, out = self.graphs[key]
        s_slots.fill_(self.dec.scratch_slot)
        s_slots[:B].copy_(slots)
        s_codes[:B].copy_(codes)
        graph.replay()
        return out[:B]

    def _capture(self, bs: int, T: int):
        dev = self.dec.device
        slots = torch.full((bs,), self.dec.scratch_slot, dtype=torch.long, device=dev)   # normal tensors: the
        codes = torch.zeros(bs, T, self.dec.num_quantizers, dtype=torch.long, device=dev)  # caller writes them
        with torch.inference_mode():  # with autograd on, a capture would keep every activation alive
            self.dec.decode(slots, codes)  # warm-up (scratch slot only)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool, capture_error_mode="thread_local"):
                out = self.dec.decode(slots, codes)
        return graph, slots, codes, out


def _support(ok: bool, what: str) -> None:
    if not ok:
        raise NotImplementedError(f"this codec decoder has {what}, which StreamingCodecDecoder does not implement; "
                                  "it follows the qwen-tts 0.1.1 Qwen3TTSTokenizerV2Decoder")


def _tail(hist: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The last hist.shape[1] frames of [hist; x], without copying all of x."""
    H, n = hist.shape[1], x.shape[1]
    return x[:, n - H:].contiguous() if n >= H else torch.cat([hist[:, n:], x], 1)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


class StreamsBusyError(RuntimeError):
    """Every decoder slot is taken by a live stream."""


class SlotPool:
    """The free slots of a StreamingCodecDecoder, shared by threads. Taking one never waits: a server
    would rather answer "busy, retry" at once than hold a request in a hidden queue."""

    def __init__(self, n: int):
        self.n = n
        self.free = list(range(n - 1, -1, -1))
        self.lock = threading.Lock()

    def acquire(self) -> int:
        with self.lock:
            if not self.free:
                raise StreamsBusyError(f"all {self.n} streaming decoder slots are in use by live streams; retry when "
                                       "one ends, or raise max_streams")
            return self.free.pop()

    def release(self, slot: int) -> None:
        with self.lock:
            if slot in self.free:
                raise RuntimeError(f"decoder slot {slot} was released twice (a stream closed twice?)")
            self.free.append(slot)

    def in_use(self) -> int:
        with self.lock:
            return self.n - len(self.free)


class CodecStream:
    """One stream's handle on a streaming decoder: start(), then decode(frames) per chunk, then close().
    The async variants never block the event loop."""

    def start(self) -> None:
        raise NotImplementedError

    def decode(self, frames: list[list[int]]) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    async def astart(self) -> None:
        await asyncio.to_thread(self.start)

    async def adecode(self, frames: list[list[int]]) -> np.ndarray:
        return await asyncio.to_thread(self.decode, frames)


class LocalCodecStreams:
    """Streaming decode in this process: one StreamingCodecDecoder and its slots, one call at a time."""

    def __init__(self, decoder: nn.Module, max_streams: int):
        self.decoder = StreamingCodecDecoder(decoder, max_streams)
        # in-process, the engine thread shares the GPU: capture up front (while idle), never lazily
        self.batched = (CodecGraphs(self.decoder, 1, lazy=False) if self.decoder.device.type == "cuda"
                        else self.decoder)
        self.slots = SlotPool(max_streams)
        self.lock = threading.Lock()

    def open(self, context: torch.Tensor | None = None) -> "LocalCodecStream":
        """Take a slot (StreamsBusyError when none is free); `context` [T, Q] codes (ICL reference)
        are decoded first by start() and their audio dropped."""
        return LocalCodecStream(self, self.slots.acquire(), context)


class LocalCodecStream(CodecStream):
    def __init__(self, owner: LocalCodecStreams, slot: int, context: torch.Tensor | None):
        self.owner, self.slot, self.context = owner, slot, context
        self.slot_t = torch.tensor([slot], device=owner.decoder.device)
        self.closed = False

    def start(self) -> None:
        dec = self.owner.decoder
        with self.owner.lock:
            self._check_open()
            dec.reset(self.slot_t)
            if self.context is not None and len(self.context):
                dec.decode(self.slot_t, self.context.to(dec.device, torch.long)[None])

    def decode(self, frames: list[list[int]]) -> np.ndarray:
        dec = self.owner.decoder
        codes = torch.tensor(frames, dtype=torch.long).to(dec.device)[None]
        with self.owner.lock:
            self._check_open()
            return self.owner.batched.decode(self.slot_t, codes)[0].float().cpu().numpy()

    def _check_open(self) -> None:
        # a closed stream's slot may already belong to another stream: never touch it again
        if self.closed:
            raise RuntimeError(f"decoder stream on slot {self.slot} is closed")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.owner.slots.release(self.slot)
