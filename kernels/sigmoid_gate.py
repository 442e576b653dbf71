"""sigmoid_gate: ``x * sigmoid(gate)``, the output gates of the Qwen3-Next / Qwen3.5 layers.

Two uses, one op:
- the gated full attention: ``q_proj`` emits each head's query and gate side by side, and the
  attention output is multiplied by ``sigmoid(gate)`` before ``o_proj`` (`gate` the same shape as
  `x`, e.g. ``[tokens, heads, head_dim]`` strided views of the ``q_proj`` output);
- the MoE layer's shared expert: ``sigmoid(shared_expert_gate(h)) * shared_expert(h)``, one gate
  value per token broadcast over the hidden row (`gate` ``[..., 1]``).

Numerics follow transformers' torch path in the model dtype: ``sigmoid(gate)`` computed in fp32 and
rounded to x's dtype (``torch.sigmoid`` of a bf16 tensor), then the product computed in fp32 and
rounded once (a bf16 ``*``).

Invariance contract: element-wise, the same expression for every element (docs/design.md rule
5); the reference takes the sigmoid from `exact_math.sigmoid` (torch's own is not position-
independent on the CPU). The backward (rule 8) is the analytic formula in fp32 by torch ops on
both backends (the broadcast gate's gradient summed over its row).
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import require_triton, tl, triton
from .backend import select
from .row_view import as_rows

GATE_BLOCK = 1024  # columns per program


@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, N, GD, stride_x, stride_gt, stride_gh, stride_out, BLOCK: tl.constexpr):
    """Program (row, column block): gate element of column c at ``(c // GD) * stride_gh + c % GD``
    (a ``[rows, heads, GD]`` view; ``GD = 1`` with ``stride_gh = 0``: one gate value a row)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    g = tl.load(g_ptr + row * stride_gt + (cols // GD) * stride_gh + cols % GD, mask=mask, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (x.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)


def rows_and_gate(x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """``(x2d, gate, GD, gate row stride, gate head stride)``: `x` as rows ``[R, N]`` with unit
    column stride and how the kernel addresses `gate` for them. A 3-D ``[tokens, heads, head_dim]``
    pair keeps the gate's strides (a strided view of the ``q_proj`` output is read in place, x's
    rows are tokens); a ``[..., 1]`` gate is one value a row; otherwise the gate as rows too."""
    if gate.shape != x.shape:  # the broadcast gate, checked by `sigmoid_gate`
        g = gate.reshape(-1, 1)
        return as_rows(x), g, 1, g.stride(0), 0
    if x.dim() == 3 and gate.stride(-1) == 1:
        return as_rows(x, x.shape[1] * x.shape[2]), gate, gate.shape[-1], gate.stride(0), gate.stride(1)
    g = as_rows(gate, x.shape[-1])
    return as_rows(x), g, x.shape[-1], g.stride(0), 0


def sigmoid_gate_triton(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (`rows_and_gate`'s layout); a contiguous output of x's shape."""
    require_triton("sigmoid_gate")
    x2d, g, gd, stride_gt, stride_gh = rows_and_gate(x, gate)
    rows, n = x2d.shape
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    if x2d.numel():
        _sigmoid_gate_kernel[(rows, triton.cdiv(n, GATE_BLOCK))](
            x2d, g, out, n, gd, x2d.stride(0), stride_gt, stride_gh, out.stride(0), BLOCK=GATE_BLOCK, num_warps=4,
            enable_fp_fusion=True)
    return out.reshape(x.shape)


def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The CPU reference: `exact_math.sigmoid` rounded to x's dtype, the product in fp32 (fp64)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = exact_math.sigmoid(gate.to(compute)).to(x.dtype).to(compute)
    return (x.to(compute) * s).to(x.dtype)


def _forward(x, gate):
    backend = select("sigmoid_gate", x, fast=True)
    if backend == "triton":
        return sigmoid_gate_triton(x, gate)
    if backend == "fast":  # HF's code
        return x * torch.sigmoid(gate)
    return sigmoid_gate_reference(x, gate)


def sigmoid_gate_backward(x: torch.Tensor, gate: torch.Tensor,
                          grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_gate) of ``x * sigmoid(gate)`` in fp32 (fp64); torch ops (docs/design.md rule 8)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    g, xf, dy = gate.to(compute), x.to(compute), grad_out.to(compute)
    s = torch.sigmoid(g)
    grad_g = dy * xf * s * (1.0 - s)
    if gate.shape != x.shape:
        grad_g = grad_g.sum(-1, keepdim=True)
    return (dy * s).to(x.dtype), grad_g.to(gate.dtype)


class _SigmoidGateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate):
        ctx.save_for_backward(x, gate)
        return _forward(x, gate)

    @staticmethod
    def backward(ctx, grad_out):
        x, gate = ctx.saved_tensors
        return sigmoid_gate_backward(x, gate, grad_out)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` at HF's rounding points (the module docstring).

    `gate`: x's shape (the attention's output gate; ``[tokens, heads, head_dim]`` strided views are
    read in place) or ``x.shape[:-1] + (1,)`` (the shared expert's gate, one value a row); x's
    dtype. Returns a tensor of x's shape and dtype; differentiable in `x` and `gate`.
    """
    if x.dim() == 0 or gate.dtype != x.dtype or gate.shape not in (x.shape, x.shape[:-1] + (1,)):
        raise ValueError(f"sigmoid_gate: gate {tuple(gate.shape)} {gate.dtype} must be x's shape {tuple(x.shape)} or "
                         f"{tuple(x.shape[:-1]) + (1,)}, of x's dtype {x.dtype}")
    if torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad):
        return _SigmoidGateFunction.apply(x, gate)
    return _forward(x, gate)
