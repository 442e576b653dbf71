"""gelu_tanh_and_mul: gelu_tanh(gate) * up, the GeGLU activation of Gemma's MLP
(``hidden_activation="gelu_pytorch_tanh"``).

Computed in fp32 as ``0.5 * g * (1 + tanh(c * (g + 0.044715 * g**3))) * up`` with
``c = sqrt(2 / pi)`` and ``tanh(y) = 1 - 2 / (1 + exp(2y))``, rounded once to the input dtype.

Invariance contract: element-wise, the same expression for every element (docs/design.md rule 5).
The reference uses `exact_math.exp` (position-independent on CPU, as `silu_and_mul`'s sigmoid).
The backward is the analytic formula in fp32 (rule 8): one Triton pass on CUDA, torch ops on CPU.
"""

from __future__ import annotations

import math

import torch

from . import exact_math
from ._triton import require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs

BLOCK = 1024  # elements per program, forward and backward
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@triton.jit
def _gelu_tanh_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n, c, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inner = c * (g + 0.044715 * g * g * g)
    t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))
    tl.store(out_ptr + offs, (0.5 * g * (1.0 + t) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_and_mul_bwd_kernel(gate_ptr, up_ptr, grad_ptr, dgate_ptr, dup_ptr, n, c, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    go = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inner = c * (g + 0.044715 * g * g * g)
    t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))
    dgelu = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * g * g)
    tl.store(dgate_ptr + offs, (go * u * dgelu).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (go * 0.5 * g * (1.0 + t)).to(dup_ptr.dtype.element_ty), mask=mask)


def _tanh_parts(g: torch.Tensor) -> torch.Tensor:
    inner = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
    return 1.0 - 2.0 / (1.0 + exact_math.exp(2.0 * inner).to(g.dtype))


def gelu_tanh_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The CPU reference: the module docstring's formula in fp32 (fp64 for fp64), rounded once."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(compute), up.to(compute)
    return (0.5 * g * (1.0 + _tanh_parts(g)) * u).to(gate.dtype)


def gelu_tanh_and_mul_backward_reference(gate: torch.Tensor, up: torch.Tensor,
                                         grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up), the analytic formula in fp32 (fp64)."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u, go = gate.to(compute), up.to(compute), grad_out.to(compute)
    t = _tanh_parts(g)
    dgelu = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * g * g)
    return (go * u * dgelu).to(gate.dtype), (go * 0.5 * g * (1.0 + t)).to(up.dtype)


def _launch(kernel, *tensors, n: int, **kwargs) -> None:
    require_triton("gelu_tanh_and_mul")
    if n:
        kernel[(triton.cdiv(n, BLOCK),)](*tensors, n, SQRT_2_OVER_PI, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=True, **kwargs)


class _GeluTanhAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        if select("gelu_tanh_and_mul", gate) != "triton":
            return gelu_tanh_and_mul_reference(gate, up)
        out = torch.empty_like(gate)
        _launch(_gelu_tanh_and_mul_kernel, gate, up, out, n=gate.numel(), **dependent_launch_kwargs(gate.device))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if select("gelu_tanh_and_mul", gate) != "triton":
            return gelu_tanh_and_mul_backward_reference(gate, up, grad_out)
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        _launch(_gelu_tanh_and_mul_bwd_kernel, gate, up, grad_out, dgate, dup, n=gate.numel())
        return dgate, dup


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for two tensors of the same shape and dtype; differentiable."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gelu_tanh_and_mul: gate {tuple(gate.shape)}/{gate.dtype} and up "
                         f"{tuple(up.shape)}/{up.dtype} must match")
    return _GeluTanhAndMulFunction.apply(gate.contiguous(), up.contiguous())
