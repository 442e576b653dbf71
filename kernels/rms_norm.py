"""rms_norm: y = weight * (x * rsqrt(mean(x**2) + eps)) over the last dim, batch-invariant;
add_rms_norm: the same after a residual add (``x + residual``), fused into the one row kernel.

Numerics follow HF's Qwen3RMSNorm: statistics in fp32, the normalized row cast to the input
dtype, then multiplied by the weight and rounded to the input dtype again. Works for hidden
rows ``[..., hidden]`` and per-head q/k norm ``[..., heads, head_dim]`` alike (rows are rows).
``zero_centred=True`` is Qwen3-Next's and Qwen3.5's norm (``Qwen3NextRMSNorm``): the weight is
stored as an offset from 1, and HF multiplies the fp32 normalized row by ``1 + weight`` (in fp32)
and rounds once, without the intermediate rounding; the same rows, tile and reduction.

Invariance contract: each row is reduced by one program with a tile shape fixed by the row
length alone (`norm_tile`), never by the number of rows (docs/design.md rule 3). The reference reduces
with `exact_math.row_sum`. The backward (rule 8: correct and fast, no invariance) is the analytic
formula in fp32: one Triton pass per row on CUDA (with the residual stream's gradient added in
the same pass for add_rms_norm), the torch reference on CPU.
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import launch_warps, next_power_of_2, num_sms, require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .row_view import as_rows, in_shape


def norm_tile(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS per program, num_warps) of the forward: a function of the row length only.

    About 1,024 elements a program: a decode batch's rows spread over many SMs (Qwen3-0.6B at 128
    rows: 1,024-wide hidden rows one a program, 2.6 -> 1.8 us; 128-wide q/k heads eight a program
    in `rotary_cache_write`, 4.2 -> 2.6 us; `benchmarks/investigations/row_kernels.py`, H200, 2026-11-28; no
    slower at training's 8,192 rows). For bf16 every row keeps the lanes and warps it had on the
    earlier 8,192-element tiles (a 1,024-wide row: 128 lanes of 8 values over 4 warps), so `tl.sum`
    adds it in the same order: the same bits (checked there and by the invariance sweep on the
    H200; the compiled sm_90 layouts by tests/test_kernel_resources.py). fp32 rows of 1,024 now
    take two passes of 4 warps instead of one of 8: other fp32 bits, on both paths alike."""
    block_n = next_power_of_2(n)
    rows = max(1, 1024 // block_n)  # short rows (per-head q/k norm): several per program
    num_warps = 4 if block_n * rows <= 1024 else 8
    return block_n, rows, num_warps


def norm_launch_tile(op: str, n: int, tile: tuple[int, int] | None) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS per program, num_warps) of a norm launch over rows of `n`: `norm_tile(n)`
    when `tile` is None, else the caller's ``(rows, warps)`` (benchmarks sweeping launch shapes,
    `benchmarks/investigations/row_kernels.py`), checked. A row's reduction order follows the tile's layout, so
    a tile other than `norm_tile`'s is for measuring, not for models (docs/design.md rule 3)."""
    block_n, rows, num_warps = norm_tile(n)
    if tile is None:
        return block_n, rows, num_warps
    rows, warps = tile
    if rows < 1 or rows > 64 or rows != next_power_of_2(rows):
        raise ValueError(f"{op}: tile rows={rows} must be a power of two from 1 to 64")
    return block_n, rows, launch_warps(op, warps, num_warps)


@triton.jit
def load_rows(x_ptr, rows, n_rows, cols, N, heads, stride_x, stride_xh):
    """(tile ``[ROWS, BLOCK_N]`` of rows `rows`, its mask, the rows as int64 ``[ROWS, 1]``): row r
    of x is (token r // heads, head r % heads), so that per-head norms read a strided ``[T, H, D]``
    view. Shared with `rotary_cache_write`'s kernel: the same loads give the tile the same layout."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    rows64 = rows[:, None].to(tl.int64)
    x_row = (rows64 // heads) * stride_x + (rows64 % heads) * stride_xh
    return tl.load(x_ptr + x_row + cols[None, :], mask=mask, other=0.0), mask, rows64


@triton.jit
def normalize_rows(x, w_ptr, cols, N, eps):
    """The fp32 product ``weight * normalized row`` of each row of the tile ``x [ROWS, BLOCK_N]``
    (in x's dtype; columns past `N` zero), before its rounding to the output dtype. Shared with
    `rotary_cache_write`'s kernel, which must give these bits: the same code on the same tile
    (`norm_tile`, `load_rows`) reduces each row in the same order."""
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd[:, None]).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    return normed.to(tl.float32) * w.to(tl.float32)


@triton.jit
def normalize_rows_centred(x, w_ptr, cols, N, eps):
    """`normalize_rows` of a zero-centred norm: the fp32 product ``(1 + weight) * normalized row``,
    the normalized row not rounded first (HF's ``Qwen3NextRMSNorm``); the same row sum."""
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    return (xf * rstd[:, None]) * (1.0 + w.to(tl.float32))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_rows, N, heads, stride_x, stride_xh, stride_res,
                     stride_out, stride_sum, eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False, ZERO_CENTRED: tl.constexpr = False):
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    x, mask, rows64 = load_rows(x_ptr, rows, n_rows, cols, N, heads, stride_x, stride_xh)
    if HAS_RESIDUAL:  # the residual add, rounded to x's dtype as a separate torch add would be
        r = tl.load(res_ptr + rows64 * stride_res + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + rows64 * stride_sum + cols[None, :], x, mask=mask)
    if ZERO_CENTRED:
        y = normalize_rows_centred(x, w_ptr, cols, N, eps)
    else:
        y = normalize_rows(x, w_ptr, cols, N, eps)
    tl.store(out_ptr + rows64 * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x2d: torch.Tensor, weight: torch.Tensor, eps: float, res2d: torch.Tensor | None = None,
                    tile: tuple[int, int] | None = None, zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, x2d + res2d) with a residual, else (normed, x2d), by the Triton row kernel. `x2d`
    may also be a ``[T, H, D]`` view with unit last stride (rows = its T*H (token, head) pairs; no
    residual); the output is then contiguous ``[T*H, D]``. `tile`: ``(rows per program, warps)``
    in place of `norm_tile`'s (`norm_launch_tile`; launch-shape sweeps only). `zero_centred`: the
    ``(1 + weight)`` norm (the module docstring)."""
    require_triton("rms_norm")
    n = x2d.shape[-1]
    n_rows = x2d.numel() // n if n else 0
    heads, stride_h = (x2d.shape[1], x2d.stride(1)) if x2d.dim() == 3 else (1, 0)
    out = torch.empty(n_rows, n, device=x2d.device, dtype=x2d.dtype)
    summed = x2d if res2d is None else torch.empty_like(x2d)
    if n_rows == 0:
        return out, summed
    block_n, rows, num_warps = norm_launch_tile("rms_norm", n, tile)
    res = out if res2d is None else res2d
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x2d, res, weight, out, summed, n_rows, n, heads, x2d.stride(0), stride_h, res.stride(0), out.stride(0),
        summed.stride(0), eps, BLOCK_N=block_n, ROWS=rows, HAS_RESIDUAL=res2d is not None, num_warps=num_warps,
        ZERO_CENTRED=zero_centred, **dependent_launch_kwargs(x2d.device), enable_fp_fusion=True)
    return out, summed


def rms_norm_reference(x2d: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """The CPU reference: the row sum by `exact_math.row_sum`, HF's rounding points."""
    compute = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    xf = x2d.to(compute)
    var = exact_math.row_sum(xf * xf) / x2d.shape[-1]
    rstd = 1.0 / torch.sqrt(var + eps)
    if zero_centred:
        return ((xf * rstd[:, None]) * (1.0 + weight.to(compute))).to(x2d.dtype)
    normed = (xf * rstd[:, None]).to(x2d.dtype)
    return (normed.to(compute) * weight.to(compute)).to(x2d.dtype)


def _add(x2d: torch.Tensor, res2d: torch.Tensor) -> torch.Tensor:
    """x + residual in fp32 (fp64), rounded once to x's dtype: what torch's add does for bf16."""
    compute = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    return (x2d.to(compute) + res2d.to(compute)).to(x2d.dtype)


def _rms_norm_forward(x2d, weight, eps, res2d=None, zero_centred=False) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed): summed = x2d + res2d (or x2d itself without a residual)."""
    backend = select("rms_norm", x2d, fast=True)
    if backend == "triton":
        return rms_norm_triton(x2d, weight, eps, res2d, zero_centred=zero_centred)
    summed = x2d if res2d is None else _add(x2d, res2d)
    if backend == "fast":  # torch's own (not promised row-invariant)
        if zero_centred:
            return torch.nn.functional.rms_norm(summed.float(), (summed.shape[-1],), 1.0 + weight.float(),
                                                eps).to(summed.dtype), summed
        return torch.nn.functional.rms_norm(summed, (summed.shape[-1],), weight, eps), summed
    return rms_norm_reference(summed, weight, eps, zero_centred), summed


def _backward_tile(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS per loop step, num_warps) of the backward: short rows (per-head q/k norm,
    128 wide) go 16 to a step, so a step moves 8 KiB of x and of g instead of 512 bytes."""
    block_n = next_power_of_2(n)
    rows = max(1, min(16, 2048 // block_n))
    return block_n, rows, 4 if block_n * rows <= 2048 else 8


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, g_ptr, w_ptr, extra_ptr, z_ptr, dx_ptr, dz_ptr, dw_ptr, n_rows, N, stride_x, stride_g,
                         stride_extra, stride_z, stride_dx, stride_dz, eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                         HAS_EXTRA: tl.constexpr, GATED: tl.constexpr = False):
    """Row blocks pid, pid + programs, ... of `ROWS` rows each: dx of each row (plus `extra`, the
    residual stream's own gradient) and this program's partial sum of dW = sum over rows of g * x_hat.
    `GATED` (`gated_rms_norm`: the output times ``silu(z)``): also d z, and g times ``silu(z)`` is
    the gradient reaching the norm."""
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), tl.float32)
    for block in range(tl.program_id(0), tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
        # 64-bit offsets (a loop index is int32; a Python int when interpreted)
        rows = (tl.full((), 0, tl.int64) + block) * ROWS + tl.arange(0, ROWS)
        mask = (rows[:, None] < n_rows) & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        x_hat = x * rstd[:, None]
        if GATED:
            z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-z))
            dz = g * x_hat * w[None, :] * sig * (1.0 + z * (1.0 - sig))
            tl.store(dz_ptr + rows[:, None] * stride_dz + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
            g = g * z * sig
        gw = g * w[None, :]
        dx = rstd[:, None] * (gw - x_hat * (tl.sum(gw * x_hat, axis=1) / N)[:, None])
        if HAS_EXTRA:
            dx += tl.load(extra_ptr + rows[:, None] * stride_extra + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(g * x_hat, axis=0)
    tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * N + cols, dw, mask=col_ok)


def rms_norm_backward_triton(x2d: torch.Tensor, weight: torch.Tensor, eps: float, grad_out: torch.Tensor,
                             extra: torch.Tensor | None = None, gate: torch.Tensor | None = None):
    """(grad_x, grad_weight) of rows ``[R, D]`` by the one-pass Triton kernel, `extra` (the residual
    stream's gradient) added to grad_x; with a `gate` (rows like x: `gated_rms_norm`'s) the triple
    (grad_x, grad_weight, grad_gate)."""
    require_triton("rms_norm")
    n_rows, n = x2d.shape
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    dx = torch.empty_like(x2d)
    dz = torch.empty_like(gate) if gate is not None else dx
    block_n, rows, num_warps = _backward_tile(n)
    programs = max(1, min(triton.cdiv(n_rows, rows), 4 * num_sms(x2d.device)))
    partial = torch.empty(programs, n, device=x2d.device, dtype=torch.float32)
    if n_rows:
        _rms_norm_bwd_kernel[(programs,)](
            x2d, grad_out, weight, extra if extra is not None else grad_out, gate if gate is not None else x2d, dx, dz,
            partial, n_rows, n, x2d.stride(0), grad_out.stride(0), extra.stride(0) if extra is not None else 0,
            gate.stride(0) if gate is not None else 0, dx.stride(0), dz.stride(0), eps, BLOCK_N=block_n, ROWS=rows,
            HAS_EXTRA=extra is not None, GATED=gate is not None, num_warps=num_warps, enable_fp_fusion=True)
    else:
        partial.zero_()
    grads = dx, partial.sum(0).to(weight.dtype)
    return grads if gate is None else (*grads, dz)


def rms_norm_backward_reference(x2d: torch.Tensor, weight: torch.Tensor, eps: float, grad_out: torch.Tensor,
                                extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) of ``rms_norm(x2d)`` by the analytic formula in fp32 (fp64), plus
    `extra` (the residual stream's gradient) added to grad_x before its rounding to x's dtype."""
    compute = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    xf, g, w = x2d.to(compute), grad_out.to(compute), weight.to(compute)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = xf * rstd
    gw = g * w
    grad_x = rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))
    if extra is not None:
        grad_x = grad_x + extra.to(compute)
    return grad_x.to(x2d.dtype), (g * x_hat).sum(0).to(weight.dtype)


def _rms_norm_backward(x2d, weight, eps, grad_out, extra=None, zero_centred=False):
    """(grad_x in x's dtype, grad_weight): the Triton kernel on CUDA (one pass; rule 8), else
    the reference formula. A zero-centred norm is the plain one with the weight ``1 + weight``
    (fp32), whose gradient is the offset's."""
    scale = (1.0 + weight.to(torch.float64 if weight.dtype == torch.float64 else torch.float32)) if zero_centred \
        else weight
    if select("rms_norm", x2d) == "triton":
        grad_x, grad_w = rms_norm_backward_triton(x2d, scale, eps, grad_out, extra)
    else:
        grad_x, grad_w = rms_norm_backward_reference(x2d, scale, eps, grad_out, extra)
    return grad_x, grad_w.to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps, zero_centred):
        ctx.save_for_backward(x2d, weight)
        ctx.eps, ctx.zero_centred = eps, zero_centred
        return _rms_norm_forward(x2d, weight, eps, zero_centred=zero_centred)[0]

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        grad_x, grad_w = _rms_norm_backward(x2d, weight, ctx.eps, grad_out, zero_centred=ctx.zero_centred)
        return grad_x, grad_w, None, None


class _AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, res2d, weight, eps, zero_centred):
        normed, summed = _rms_norm_forward(x2d, weight, eps, res2d, zero_centred)
        ctx.save_for_backward(summed, weight)
        ctx.eps, ctx.dtypes, ctx.zero_centred = eps, (x2d.dtype, res2d.dtype), zero_centred
        return normed, summed

    @staticmethod
    def backward(ctx, grad_normed, grad_summed):
        summed, weight = ctx.saved_tensors
        # the sum also continues as the residual stream: its gradient joins before the rounding
        grad_s, grad_w = _rms_norm_backward(summed, weight, ctx.eps, grad_normed, grad_summed, ctx.zero_centred)
        return grad_s.to(ctx.dtypes[0]), grad_s.to(ctx.dtypes[1]), grad_w, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """RMS-normalize the last dimension of `x` and scale by `weight` (``[x.shape[-1]]``), or by
    ``1 + weight`` with `zero_centred` (Qwen3-Next's and Qwen3.5's norms; the module docstring).

    Returns a tensor of ``x.dtype`` and shape; differentiable in `x` and `weight`.
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} must be ({x.shape[-1]},)")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out = _RMSNormFunction.apply(as_rows(x), weight, eps, zero_centred)
    elif x.dim() == 3 and x.stride(-1) == 1 and select("rms_norm", x, fast=True) == "triton":
        out = rms_norm_triton(x, weight, eps, zero_centred=zero_centred)[0]  # per-head rows of a strided view
    else:
        out = _rms_norm_forward(as_rows(x), weight, eps, zero_centred=zero_centred)[0]
    return in_shape(out, x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed = x + residual`` (rounded to x's dtype, as ``x + residual`` would be) and
    ``rms_norm(summed, weight, eps)``, in one kernel: the pre-norm transformer's residual add
    and the next norm, without a separate add kernel and its round trip through memory.

    Returns ``(normed, summed)``, bitwise what the two separate ops give (the same row kernel).
    Differentiable in `x`, `residual` and `weight`. `zero_centred`: as for `rms_norm`.
    """
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm: weight shape {tuple(weight.shape)} must be ({x.shape[-1]},)")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    x2d, res2d = as_rows(x), as_rows(residual)
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad):
        normed, summed = _AddRMSNormFunction.apply(x2d, res2d, weight, eps, zero_centred)
    else:
        normed, summed = _rms_norm_forward(x2d, weight, eps, res2d, zero_centred)
    return in_shape(normed, x.shape), in_shape(summed, x.shape)
