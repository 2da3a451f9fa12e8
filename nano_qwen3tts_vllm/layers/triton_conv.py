"""Causal 1-d convolution on time-major activations [B, T, C] as one Triton implicit-GEMM kernel.

    y[b, t] = bias + sum_j W[j] . pre(z[b, t + j * dil]),  z = [hist; x]

(hist: the H = (taps - 1) * dil inputs before x), with an optional SnakeBeta `pre` on every input and an optional
residual added to y. Against unfold + matmul it never writes the inputs `taps` times over, reads the carried
history in place instead of concatenating it, and adds the residual in its epilogue. `pre` is computed per tap
and per output tile, so it pays only for a 1x1 convolution with one output tile (a sin per element is not free).
Float32 inputs multiply in IEEE float32 (no TF32), so the fp32 parity checks hold; half precision accumulates in
float32 and rounds once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])  # one compile for any number of frames
def _causal_conv_kernel(x_ptr, hist_ptr, w_ptr, bias_ptr, alpha_ptr, inv_beta_ptr, res_ptr, y_ptr, n, C, O,
                        TAPS: tl.constexpr, DIL: tl.constexpr, SNAKE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_RES: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_O: tl.constexpr, BLOCK_C: tl.constexpr):
    H: tl.constexpr = (TAPS - 1) * DIL
    b = tl.program_id(2).to(tl.int64)
    t0 = tl.program_id(0) * BLOCK_T
    t = t0 + tl.arange(0, BLOCK_T)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    t_ok, o_ok = t < n, o < O
    x_row, h_row = x_ptr + b * n * C, hist_ptr + b * H * C
    acc = tl.zeros([BLOCK_T, BLOCK_O], dtype=tl.float32)
    chunks = tl.cdiv(C, BLOCK_C)
    for k in range(TAPS * chunks):  # one flat loop over (tap, channel block): Triton pipelines its loads
        j = k // chunks
        c = (k - j * chunks) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = c < C
        src = t + j * DIL - H  # the input frame this tap reads: < 0 is in the carried history
        z = tl.load(x_row + src[:, None] * C + c[None, :], mask=(t_ok & (src >= 0))[:, None] & c_ok[None, :],
                    other=0.0)
        if H > 0:
            if t0 < H:  # only the first tiles reach back into the history
                z += tl.load(h_row + (src + H)[:, None] * C + c[None, :],
                             mask=(t_ok & (src < 0))[:, None] & c_ok[None, :], other=0.0)
        if SNAKE:  # snake(0) == 0: masked-out inputs stay zero
            alpha = tl.load(alpha_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
            inv_beta = tl.load(inv_beta_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
            zf = z.to(tl.float32)
            s = tl.sin(alpha[None, :] * zf)
            z = (zf + inv_beta[None, :] * s * s).to(z.dtype)
        w = tl.load(w_ptr + (j * C + c[:, None]) * O + o[None, :], mask=c_ok[:, None] & o_ok[None, :], other=0.0)
        acc = tl.dot(z, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + o, mask=o_ok, other=0.0).to(tl.float32)[None, :]
    out = (b * n + t[:, None]) * O + o[None, :]
    mask = t_ok[:, None] & o_ok[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + out, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def causal_conv(x: torch.Tensor, hist: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                dilation: int = 1, snake: tuple[torch.Tensor, torch.Tensor] | None = None,
                residual: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [B, n, C] new inputs; hist [B, (taps - 1) * dilation, C] the inputs before them (None for taps == 1);
    weight [taps, C, O]; snake (alpha, inv_beta) [C] applied to every input; residual [B, n, O] added.
    Returns y [B, n, O] in x's dtype. x, hist and residual are made contiguous."""
    taps, C, O = weight.shape
    B, n = x.shape[:2]
    if x.shape[2] != C or (taps > 1) != (hist is not None):
        raise ValueError(f"causal_conv: x {tuple(x.shape)} / hist {None if hist is None else tuple(hist.shape)} "
                         f"do not fit a weight of {taps} taps x {C} in x {O} out")
    if hist is not None and tuple(hist.shape) != (B, (taps - 1) * dilation, C):
        raise ValueError(f"causal_conv: hist must be [{B}, {(taps - 1) * dilation}, {C}], got {tuple(hist.shape)}")
    x = x.contiguous()
    y = torch.empty(B, n, O, dtype=x.dtype, device=x.device)
    if B == 0 or n == 0:
        return y
    hist = x if hist is None else hist.contiguous()
    alpha, inv_beta = snake if snake is not None else (x, x)
    res = residual.contiguous() if residual is not None else y
    cfg = config or _config(n, O, taps)
    grid = (triton.cdiv(n, cfg["BLOCK_T"]), triton.cdiv(O, cfg["BLOCK_O"]), B)
    _causal_conv_kernel[grid](
        x, hist, weight, bias if bias is not None else x, alpha, inv_beta, res, y, n, C, O,
        TAPS=taps, DIL=dilation, SNAKE=snake is not None, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **cfg)
    return y


def _config(n: int, O: int, taps: int) -> dict:
    """The best of a sweep on an H100 for the codec decoder's shapes (B=64 x 25 frames, 96..768 channels)."""
    if taps == 1 or n * O <= 800 * 768 or O <= 64:
        return dict(BLOCK_T=64, BLOCK_O=min(128, max(16, triton.next_power_of_2(O))), BLOCK_C=32, num_warps=4,
                    num_stages=3)
    return dict(BLOCK_T=128, BLOCK_O=128, BLOCK_C=32, num_warps=8, num_stages=3)
