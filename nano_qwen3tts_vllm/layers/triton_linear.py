"""Linear layers for a few rows (decode at small batch) as one Triton GEMV kernel.

At one row cuBLAS picks GEMM tiles of 64 output features: the predictor's 1024..6144-feature projections then
run on 16..96 of the H100's 132 SMs, each streaming 128 KB or more of weights. Here every program owns a thin
slice of 4 or 8 output features and reads its weights in one to three wide loads (hundreds of programs, all of
them streaming at once), then reduces each row against them in turn. The qkv and gate/up projections can also
take the add + RMSNorm before them in their prologue, and gate/up SiLU(gate) * up in its epilogue; the
predictor's input projection gathers its embedding rows itself (`embedding_linear`). On Hopper the kernel launches
with PDL (layers/pdl.py): its weights stream in while the kernel before it finishes.

Products are summed in float32 and the output rounded once, as a GEMM with float32 accumulation does (the
summation order differs), so a row's result is the same in a batch of one or two but can differ by a rounding
from the same row in a larger batch. CPU tensors, larger batches and other dtypes take torch's matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
import triton
import triton.language as tl

from .pdl import launch_dependents, use_pdl, wait_prior

MAX_ROWS = 2  # a lone stream's steps (the predictor's first step has two rows); from 4 rows on cuBLAS is faster


@triton.jit
def _row_input(x_ptr, idx_ptr, idx_offset, r_ptr, nw_ptr, r_out_ptr, m, row_ok, kk, k_ok, K, stride_x, eps,
               out_ty: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Row m of the input over columns kk, in float32: x[m], or with GATHER the table row idx[m] + idx_offset.
    With NORM the add_rms_norm / rms_norm of layers/fused.py (rounded as there; kk must then cover the whole
    row), the sum written out by program 0."""
    x_row = m * stride_x
    if GATHER:
        x_row = (tl.load(idx_ptr + m, mask=row_ok, other=0) + idx_offset).to(tl.int64) * stride_x
    ok = k_ok & row_ok
    x = tl.load(x_ptr + x_row + kk, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        if HAS_RESIDUAL:
            x = (x + tl.load(r_ptr + m * stride_x + kk, mask=ok, other=0.0).to(tl.float32)).to(out_ty)
            if tl.program_id(0) == 0:
                tl.store(r_out_ptr + m * stride_x + kk, x, mask=ok)
            x = x.to(tl.float32)
        rs = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        nw = tl.load(nw_ptr + kk, mask=ok, other=0.0).to(tl.float32)
        x = (nw * (x * rs).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(x_ptr, idx_ptr, idx_offset, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, r_out_ptr, M, N, K, stride_x,
                 stride_y, up_offset, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """Each row is reduced with the same ops whatever M is: a row's result does not depend on its batch.
    With PDL the weights stream in while the previous kernel finishes (layers/pdl.py)."""
    launch_dependents(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    out_ty = y_ptr.dtype.element_ty
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one iteration with NORM (BLOCK_K >= K): the norm needs the whole row
        kk = k0 + rk
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if SILU_MUL:
            u = tl.load(w_rows + up_offset * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
        wait_prior(PDL)  # the inputs come from the previous kernel (a no-op after the first chunk)
        for m in tl.static_range(BLOCK_M):  # the weights stay in registers for every row
            x = _row_input(x_ptr, idx_ptr, idx_offset, r_ptr, nw_ptr, r_out_ptr, m, m < M, kk, k_ok, K, stride_x,
                           eps, out_ty, GATHER, NORM, HAS_RESIDUAL)
            acc = tl.where(rm[:, None] == m, acc + tl.sum(w * x[None, :], axis=1)[None, :], acc)
            if SILU_MUL:
                acc_up = tl.where(rm[:, None] == m, acc_up + tl.sum(u * x[None, :], axis=1)[None, :], acc_up)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:  # gate and up rounded as the GEMM's output would be, then SiLU(gate) * up rounded once
        gate = acc.to(out_ty).to(tl.float32)
        up = acc_up.to(out_ty).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(out_ty), mask=(rm < M)[:, None] & n_ok[None, :])


def _config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from a sweep on an H100 over the talker's and predictor's shapes with
    the weights streamed from HBM (1 row; within ~5% of the best configuration of each shape)."""
    return (8 if n >= 6144 else 4), (triton.next_power_of_2(k) if k <= 4096 else 2048), 4


def uses_gemv(x: torch.Tensor, weight: torch.Tensor, rows: int | None = None) -> bool:
    """Whether x @ weight.T takes the kernel: CUDA, at most MAX_ROWS rows (x's, or `rows` gathered from the table
    x), one float dtype, contiguous weight."""
    if rows is None:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.is_cuda and 0 < rows <= MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.is_contiguous())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows), weight [N, K] -> x @ weight.T + bias [..., N]; with silu_mul the
    weight is [gate; up] (2I rows) and the result SiLU(x @ gate.T) * (x @ up.T) [..., I]."""
    return _launch(x, weight, bias, silu_mul, config)[0]


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x) or x, RMS-normalised and projected in one kernel: returns (the projection as `gemv`,
    the sum), the pair `add_rms_norm` + projection would give."""
    return _launch(x, weight, None, silu_mul, None, (residual, norm_weight, eps))


def embedding_gemv(ids: torch.Tensor, offset: int, table: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """ids [...] (at most MAX_ROWS) -> F.linear(F.embedding(ids + offset, table), weight, bias) [..., N], the
    table rows gathered in the kernel's prologue: a lookup and its projection in one launch."""
    return _launch(table, weight, bias, False, None, gather=(ids, offset))[0]


def _launch(x, weight, bias, silu_mul, config, norm=None, gather=None) -> tuple[torch.Tensor, torch.Tensor]:
    K = x.shape[-1]
    if gather is not None:
        ids, idx_offset = gather
        lead, x2, idx = ids.shape, x, ids.reshape(-1)
        M = idx.numel()
    else:
        lead, idx, idx_offset = x.shape[:-1], x, 0
        x2 = x.reshape(-1, K).contiguous()
        M = x2.shape[0]
    N = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or _config(N, K)
    residual, norm_weight, eps = norm or (None, weight, 0.0)
    r_out = x
    if residual is not None:
        residual = residual.reshape(M, K).contiguous()
        r_out = torch.empty_like(x2)
    if norm is not None:
        assert gather is None, "the gathered rows have no residual stream"
        block_k = triton.next_power_of_2(K)
    pdl = use_pdl(x)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x2, idx, idx_offset, weight, bias if bias is not None else weight, y,
        residual if residual is not None else x2, norm_weight, r_out, M, N, K, x2.stride(0), y.stride(0), N, eps,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul, GATHER=gather is not None, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return y.view(*lead, N), r_out.view(x.shape)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the GEMV kernel where `uses_gemv` says so."""
    if uses_gemv(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def embedding_linear(ids: torch.Tensor, offset: int, table: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(F.embedding(ids + offset, table), weight, bias); where `uses_gemv` says so one GEMV kernel that
    gathers its input rows itself."""
    if uses_gemv(table, weight, rows=ids.numel()):
        return embedding_gemv(ids, offset, table, weight, bias)
    return F.linear(F.embedding(ids + offset, table), weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose small-batch CUDA calls take the GEMV kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
