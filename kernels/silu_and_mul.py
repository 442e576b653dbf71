"""silu_and_mul: silu(gate) * up, the SwiGLU activation of the MLP.

Computed in fp32 as ``gate / (1 + exp(-gate)) * up`` and rounded once to the input dtype.

Invariance contract: element-wise, the same expression for every element (docs/design.md rule 5).
On CPU, torch's own silu is *not* position-independent (SLEEF body vs scalar tail), so the
reference uses `exact_math.sigmoid`. The backward is the analytic formula in fp32 (rule 8): one
Triton pass on CUDA, torch ops on CPU.
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import launch_warps, next_power_of_2, require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs

SILU_BLOCK = 1024  # columns per program of the forward (and elements of the backward)
SILU_WARPS = 4


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_g, stride_u, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor, block: int | None = None,
                        num_warps: int | None = None) -> torch.Tensor:
    """``silu(gate) * up`` by the Triton kernel. `gate`/`up`: rows with unit column stride (e.g.
    the two halves of one fused gate/up GEMM's output, ``[T, I]`` views with row stride 2I); the
    output is contiguous. `block` (columns per program, a power of two from 64 to 8192) and
    `num_warps` replace the defaults (launch-shape sweeps): element-wise, so every launch shape
    gives the same bits."""
    block = SILU_BLOCK if block is None else block
    if block < 64 or block > 8192 or block != next_power_of_2(block):
        raise ValueError(f"silu_and_mul: block={block} must be a power of two from 64 to 8192")
    num_warps = launch_warps("silu_and_mul", num_warps, SILU_WARPS)
    require_triton("silu_and_mul")
    shape = gate.shape
    gate, up = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])  # views for the callers' inputs
    rows, cols = gate.shape
    out = torch.empty(rows, cols, device=gate.device, dtype=gate.dtype)
    if gate.numel():
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](gate, up, out, cols, gate.stride(0), up.stride(0),
                                                                BLOCK=block, num_warps=num_warps,
                                                                **dependent_launch_kwargs(gate.device), enable_fp_fusion=True)
    return out.reshape(shape)


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(compute), up.to(compute)
    return (g * exact_math.sigmoid(g).to(compute) * u).to(gate.dtype)


def _silu_and_mul_forward(gate, up):
    backend = select("silu_and_mul", gate, fast=True)
    if backend == "fast":
        return torch.nn.functional.silu(gate) * up
    if backend == "triton":
        return silu_and_mul_triton(gate, up)
    return silu_and_mul_reference(gate, up)


@triton.jit
def _silu_and_mul_bwd_kernel(gate_ptr, up_ptr, grad_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    go = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    tl.store(dgate_ptr + offs, (go * u * sig * (1.0 + g * (1.0 - sig))).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (go * g * sig).to(dup_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_backward_reference(gate: torch.Tensor, up: torch.Tensor,
                                    grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of ``silu(gate) * up``, the analytic formula in fp32 (fp64)."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u, go = gate.to(compute), up.to(compute), grad_out.to(compute)
    sig = torch.sigmoid(g)
    grad_gate = go * u * sig * (1.0 + g * (1.0 - sig))
    return grad_gate.to(gate.dtype), (go * g * sig).to(up.dtype)


def _silu_and_mul_backward(gate, up, grad_out):
    """Contiguous `gate`, `up`, `grad_out` of one shape: one Triton pass on CUDA (rule 8), else
    the reference formula."""
    if select("silu_and_mul", gate) != "triton":
        return silu_and_mul_backward_reference(gate, up, grad_out)
    require_triton("silu_and_mul")
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        grid = (triton.cdiv(gate.numel(), SILU_BLOCK),)
        _silu_and_mul_bwd_kernel[grid](gate, up, grad_out, dgate, dup, gate.numel(), BLOCK=SILU_BLOCK, num_warps=4,
                                       enable_fp_fusion=True)
    return dgate, dup


class _SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _silu_and_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        return _silu_and_mul_backward(gate, up, grad_out.contiguous())


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for two tensors of the same shape and dtype; differentiable."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_and_mul: gate {tuple(gate.shape)}/{gate.dtype} and up "
                         f"{tuple(up.shape)}/{up.dtype} must match")
    shape = gate.shape
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluAndMulFunction.apply(gate.contiguous(), up.contiguous())
    # rows with unit column stride need no copy (the kernel takes a row stride)
    gate2d, up2d = (t.reshape(-1, shape[-1]) if shape else t.reshape(1, 1) for t in (gate, up))
    if gate2d.stride(-1) != 1 or up2d.stride(-1) != 1:
        gate2d, up2d = gate2d.contiguous(), up2d.contiguous()
    return _silu_and_mul_forward(gate2d, up2d).reshape(shape)
