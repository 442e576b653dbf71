"""gated_delta_gates: the gated-DeltaNet's per-token, per-value-head decay and write strength.

From the layer's projections ``a, b [tokens, Hv]`` (model dtype) and its parameters ``A_log``,
``dt_bias [Hv]``, transformers' torch path (``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``)
computes::

    g    = -exp(A_log in fp32) * softplus(a in fp32 + dt_bias)     fp32 (the log decay, <= 0)
    beta = sigmoid(b)                                               b's dtype (fp32 math, rounded once)

with torch's ``softplus`` (threshold 20: ``x`` itself above it). These feed `gated_delta_rule`.

Invariance contract (docs/design.md rule 5, element-wise): every element is one fixed expression
of its own inputs, computed with `exact_math` (``exp`` and ``log`` as float64 polynomials, IEEE
operations only) on every device, so a token's gates never depend on where it sits in the batch
(torch's own CPU ``sigmoid``/``exp`` do: a vectorised body and a scalar tail round differently).
There is no Triton kernel: the tensors are ``[tokens, Hv]`` (32 values a token at Qwen3.5's
shapes), a few element-wise launches per layer, the same torch ops on the CPU and the GPU.

The backward (rule 8: correct, no invariance) is the analytic formula in fp32 (fp64) by torch ops.
"""

from __future__ import annotations

import torch

from . import exact_math

SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus's default: x itself above it


def _compute(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """``log1p(exp(x))`` (x above the threshold: x), position-independent, in x's dtype. log1p(y)
    in float64 as ``log(u) * y / (u - 1)`` with ``u = 1 + y`` (``y`` itself when ``u == 1``), which
    keeps y's relative precision where ``1 + y`` alone would round it away."""
    y = exact_math.exp(x).to(torch.float64)
    u = 1.0 + y
    ratio = y / torch.where(u == 1.0, torch.ones_like(u), u - 1.0)
    soft = torch.where(u == 1.0, y, exact_math.log(u) * ratio).to(x.dtype)
    return torch.where(x > SOFTPLUS_THRESHOLD, x, soft)


def gated_delta_gates_reference(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` by the module docstring's expressions (the one implementation, every device)."""
    compute = _compute(a)
    x = a.to(compute) + dt_bias.to(compute)
    g = -exact_math.exp(a_log.to(compute)) * _softplus(x)
    beta = exact_math.sigmoid(b.to(_compute(b))).to(b.dtype)
    return g, beta


class _GatesFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, a_log, dt_bias):
        g, beta = gated_delta_gates_reference(a, b, a_log, dt_bias)
        ctx.save_for_backward(a, b, a_log, dt_bias)
        return g, beta

    @staticmethod
    def backward(ctx, grad_g, grad_beta):
        a, b, a_log, dt_bias = ctx.saved_tensors
        compute = _compute(a)
        x = a.to(compute) + dt_bias.to(compute)
        decay = torch.exp(a_log.to(compute))
        soft = torch.nn.functional.softplus(x)
        dsoft = torch.where(x > SOFTPLUS_THRESHOLD, torch.ones_like(x), torch.sigmoid(x))
        grad_g = torch.zeros_like(x) if grad_g is None else grad_g.to(compute)
        grad_x = -grad_g * decay * dsoft
        grad_a_log = (-grad_g * decay * soft).reshape(-1, a_log.shape[0]).sum(0)
        grad_b = None
        if grad_beta is not None:
            s = torch.sigmoid(b.to(_compute(b)))
            grad_b = (grad_beta.to(s.dtype) * s * (1.0 - s)).to(b.dtype)
        return (grad_x.to(a.dtype), grad_b, grad_a_log.to(a_log.dtype),
                grad_x.reshape(-1, dt_bias.shape[0]).sum(0).to(dt_bias.dtype))


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated-DeltaNet's ``(g, beta)`` (the module docstring).

    Args:
        a, b: ``[..., Hv]`` projections of one shape, in the model dtype.
        a_log, dt_bias: ``[Hv]`` parameters (any float dtype).
    Returns:
        ``g`` fp32 (fp64 for fp64 input) and ``beta`` in b's dtype, both ``a.shape``;
        differentiable in all four inputs.
    """
    heads = a_log.shape[0] if a_log.dim() == 1 else None
    if a.shape != b.shape or a.dim() < 1 or heads != a.shape[-1] or dt_bias.shape != (a.shape[-1],):
        raise ValueError(f"gated_delta_gates: a {tuple(a.shape)} and b {tuple(b.shape)} must be one shape [..., Hv] "
                         f"and A_log {tuple(a_log.shape)}, dt_bias {tuple(dt_bias.shape)} both [Hv]")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (a, b, a_log, dt_bias)):
        return _GatesFunction.apply(a, b, a_log, dt_bias)
    return gated_delta_gates_reference(a, b, a_log, dt_bias)
