"""rms_norm: y = weight * (x * rsqrt(mean(x**2) + eps)) over the last dim, batch-invariant.

Numerics follow HF's Qwen3RMSNorm: statistics in fp32, the normalized row cast to the input
dtype, then multiplied by the weight and rounded to the input dtype again. Works for hidden
rows ``[..., hidden]`` and per-head q/k norm ``[..., heads, head_dim]`` alike (rows are rows).

Invariance contract: each row is reduced by one program with a tile shape fixed by the row
length alone (`_tile`), never by the number of rows (DESIGN.md rule 3). The reference reduces
with `exact_math.row_sum`. The backward is the analytic formula in fp32 torch ops (rule 8).
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import next_power_of_2, require_triton, tl, triton
from .backend import select


def _tile(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS per program, num_warps): a function of the row length only."""
    block_n = next_power_of_2(n)
    rows = max(1, min(64, 8192 // block_n))  # short rows (per-head q/k norm): many per program
    num_warps = 4 if block_n * rows <= 2048 else 8
    return block_n, rows, num_warps


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, N, stride_x, stride_out, eps,
                     BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd[:, None]).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_triton(x2d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    require_triton("rms_norm")
    n_rows, n = x2d.shape
    out = torch.empty_like(x2d)
    if n_rows == 0:
        return out
    block_n, rows, num_warps = _tile(n)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x2d, weight, out, n_rows, n, x2d.stride(0), out.stride(0), eps,
        BLOCK_N=block_n, ROWS=rows, num_warps=num_warps)
    return out


def rms_norm_reference(x2d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    compute = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    xf = x2d.to(compute)
    var = exact_math.row_sum(xf * xf) / x2d.shape[-1]
    rstd = 1.0 / torch.sqrt(var + eps)
    normed = (xf * rstd[:, None]).to(x2d.dtype)
    return (normed.to(compute) * weight.to(compute)).to(x2d.dtype)


def _rms_norm_forward(x2d, weight, eps):
    backend = select("rms_norm", x2d, fast=True)
    if backend == "fast":  # torch's own (not promised row-invariant)
        return torch.nn.functional.rms_norm(x2d, (x2d.shape[-1],), weight, eps)
    if backend == "triton":
        return _rms_norm_triton(x2d, weight, eps)
    return rms_norm_reference(x2d, weight, eps)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps):
        ctx.save_for_backward(x2d, weight)
        ctx.eps = eps
        return _rms_norm_forward(x2d, weight, eps)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        compute = torch.float64 if x2d.dtype == torch.float64 else torch.float32
        xf, g, w = x2d.to(compute), grad_out.to(compute), weight.to(compute)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        x_hat = xf * rstd
        gw = g * w
        grad_x = rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))
        grad_w = (g * x_hat).sum(0)
        return grad_x.to(x2d.dtype), grad_w.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalize the last dimension of `x` and scale by `weight` (``[x.shape[-1]]``).

    Returns a tensor of ``x.dtype`` and shape; differentiable in `x` and `weight`.
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} must be ({x.shape[-1]},)")
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out = _RMSNormFunction.apply(x2d, weight, eps)
    else:
        out = _rms_norm_forward(x2d, weight, eps)
    return out.reshape(x.shape)
