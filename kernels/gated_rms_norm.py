"""gated_rms_norm: ``rms_norm(x) * silu(gate)`` over the last dim, the gated-DeltaNet's output norm
(transformers' ``Qwen3NextRMSNormGated`` / ``Qwen3_5RMSNormGated``), batch-invariant.

Numerics follow HF's torch path: statistics in fp32, the normalized row rounded to x's dtype and
multiplied by the weight (rounded to x's dtype again: `rms_norm`'s arithmetic), then multiplied in
fp32 by ``silu(gate)`` computed in fp32, and rounded once.

Invariance contract: each row is reduced by one program with `rms_norm`'s tile (`norm_tile`, fixed
by the row length alone) and `rms_norm`'s own code (`load_rows`, `normalize_rows`), so a row's bits
never depend on how many rows share the launch (docs/design.md rule 3); the gate is element-wise
(rule 5). The reference reduces with `exact_math.row_sum` and takes the SiLU from
`exact_math.sigmoid`. The backward (rule 8) is the analytic formula in fp32: on CUDA `rms_norm`'s
one-pass backward kernel in its gated form, torch ops on CPU.
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import require_triton, tl, triton
from .backend import select
from .rms_norm import load_rows, norm_tile, normalize_rows, rms_norm_backward_triton, rms_norm_reference
from .row_view import as_rows


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, n_rows, N, stride_x, stride_z, stride_out, eps,
                           BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    x, mask, rows64 = load_rows(x_ptr, rows, n_rows, cols, N, 1, stride_x, 0)
    y = normalize_rows(x, w_ptr, cols, N, eps).to(x.dtype).to(tl.float32)  # HF's weight * normed, rounded
    g = tl.load(z_ptr + rows64 * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = y * (g / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + rows64 * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm_triton(x2d: torch.Tensor, z2d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton forward over rows ``[R, D]`` of `x2d` and `z2d` (unit column stride; any row
    stride); a contiguous ``[R, D]`` output."""
    require_triton("gated_rms_norm")
    n_rows, n = x2d.shape
    out = torch.empty(n_rows, n, device=x2d.device, dtype=x2d.dtype)
    if n_rows:
        block_n, rows, num_warps = norm_tile(n)
        _gated_rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x2d, z2d, weight, out, n_rows, n, x2d.stride(0), z2d.stride(0), out.stride(0), eps, BLOCK_N=block_n,
            ROWS=rows, num_warps=num_warps, enable_fp_fusion=True)
    return out


def gated_rms_norm_reference(x2d: torch.Tensor, z2d: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The CPU reference: `rms_norm_reference`, then the fp32 (fp64) product with ``silu(gate)``."""
    compute = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    g = z2d.to(compute)
    silu = g * exact_math.sigmoid(g).to(compute)
    return (rms_norm_reference(x2d, weight, eps).to(compute) * silu).to(x2d.dtype)


def _forward(x2d, z2d, weight, eps):
    backend = select("gated_rms_norm", x2d, fast=True)
    if backend == "triton":
        return gated_rms_norm_triton(x2d, z2d, weight, eps)
    if backend == "fast":  # torch's ops, HF's code (not promised row-invariant)
        normed = torch.nn.functional.rms_norm(x2d.float(), (x2d.shape[-1],), eps=eps).to(x2d.dtype)
        return (weight * normed * torch.nn.functional.silu(z2d.float())).to(x2d.dtype)
    return gated_rms_norm_reference(x2d, z2d, weight, eps)


def gated_rms_norm_backward_reference(x2d: torch.Tensor, z2d: torch.Tensor, weight: torch.Tensor, eps: float,
                                      grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_gate, grad_weight) by the analytic formula in fp32 (fp64)."""
    compute = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    x, z, g, w = x2d.to(compute), z2d.to(compute), grad_out.to(compute), weight.to(compute)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = x * rstd
    sig = torch.sigmoid(z)
    grad_z = g * x_hat * w * sig * (1.0 + z * (1.0 - sig))
    gn = g * z * sig
    gw = gn * w
    grad_x = rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))
    return grad_x.to(x2d.dtype), grad_z.to(z2d.dtype), (gn * x_hat).sum(0).to(weight.dtype)


def _backward(x2d, z2d, weight, eps, grad_out):
    if select("gated_rms_norm", x2d) != "triton":
        return gated_rms_norm_backward_reference(x2d, z2d, weight, eps, grad_out)
    grad_x, grad_w, grad_z = rms_norm_backward_triton(x2d, weight, eps, grad_out, gate=z2d)
    return grad_x, grad_z, grad_w


class _GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, z2d, weight, eps):
        ctx.save_for_backward(x2d, z2d, weight)
        ctx.eps = eps
        return _forward(x2d, z2d, weight, eps)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, z2d, weight = ctx.saved_tensors
        grad_x, grad_z, grad_w = _backward(x2d, z2d, weight, ctx.eps, grad_out.contiguous())
        return grad_x, grad_z, grad_w, None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x) * silu(gate)`` over the last dim (HF's RMSNormGated).

    `x` and `gate`: one shape ``[..., D]`` and dtype (in the gated-DeltaNet: ``[tokens, value
    heads, head_v_dim]``, rows per (token, head)); `weight`: ``[D]`` of x's dtype. Returns a
    tensor of x's shape and dtype; differentiable in `x`, `gate` and `weight`.
    """
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype:
        raise ValueError(f"gated_rms_norm: weight {tuple(weight.shape)} {weight.dtype} must be ({x.shape[-1]},) "
                         f"{x.dtype}")
    if gate.shape != x.shape or gate.dtype != x.dtype:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} {gate.dtype} must match x {tuple(x.shape)} {x.dtype}")
    x2d, z2d = as_rows(x), as_rows(gate)
    if torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad or weight.requires_grad):
        out = _GatedRMSNormFunction.apply(x2d, z2d, weight, eps)
    else:
        out = _forward(x2d, z2d, weight, eps)
    return out.reshape(x.shape)
