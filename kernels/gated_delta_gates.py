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
On CUDA one Triton launch computes both (`gated_delta_gates_triton`), with `exact_math_triton`'s
float64 ``exp`` and ``log``: the same operations in the same order as the torch reference, so its
bits equal the reference's on every element (``tests/triton_checks/check_gated_delta_gates.py``).
The reference's float64 polynomials as torch ops were ~160 element-wise launches per GDN layer:
2,415 launches of a Qwen3.5-35B-A3B decode step at 256 sequences (20 layers), whose median went
from 17.43 to 12.85 ms with the kernel (docs/performance.md section 3, 2026-12-03, H200).

The backward (rule 8: correct, no invariance) is the analytic formula in fp32 (fp64) by torch ops.
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .exact_math_triton import exp64, log64
from .row_view import as_rows

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


GATES_BLOCK = 1024  # elements (token, head) per program


# sizes and strides are not specialized: every element comes from the same compiled code
@triton.jit(do_not_specialize=["n", "heads", "stride_a", "stride_b"])
def _gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_ptr, g_ptr, beta_ptr, n, heads, stride_a, stride_b,
                  BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program: `BLOCK` elements of the ``[rows, heads]`` grid, row-major; the reference's
    operations in its order (fp32 where it rounds to fp32, `exact_math_triton` in float64)."""
    wait_for_inputs(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row, head = offs // heads, offs % heads
    a = tl.load(a_ptr + row * stride_a + head, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b + head, mask=mask, other=0.0).to(tl.float32)
    x = a + tl.load(dt_ptr + head, mask=mask, other=0.0).to(tl.float32)
    y = exp64(x).to(tl.float32).to(tl.float64)  # softplus(x), as `_softplus`
    u = 1.0 + y
    ratio = y / tl.where(u == 1.0, 1.0, u - 1.0)
    soft = tl.where(u == 1.0, y, log64(u) * ratio).to(tl.float32)
    soft = tl.where(x > 20.0, x, soft)  # SOFTPLUS_THRESHOLD
    decay = exp64(tl.load(a_log_ptr + head, mask=mask, other=0.0).to(tl.float32)).to(tl.float32)
    tl.store(g_ptr + offs, -decay * soft, mask=mask)
    e = exp64(-b).to(tl.float32)  # exact_math.sigmoid in fp32: 1 / (1 + exp(-b))
    # the correctly rounded fp32 quotient, as the CPU's: a float64 division rounded to fp32 is exact
    # (double rounding cannot err for a quotient at 53 >= 2 * 24 + 2 bits); Triton's fp32 `/` approximates
    beta = (1.0 / (1.0 + e).to(tl.float64)).to(tl.float32)
    tl.store(beta_ptr + offs, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gated_delta_gates_triton(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                             dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (no autograd): `gated_delta_gates_reference`'s ``(g, beta)`` bitwise, for
    bf16 / fp16 / fp32 `a` and `b` (row-strided views are read in place)."""
    require_triton("gated_delta_gates")
    heads = a.shape[-1]
    a2d, b2d = as_rows(a), as_rows(b)
    g = torch.empty(a2d.shape, device=a.device, dtype=torch.float32)
    beta = torch.empty(b2d.shape, device=b.device, dtype=b.dtype)
    n = g.numel()
    if n:
        _gates_kernel[(triton.cdiv(n, GATES_BLOCK),)](
            a2d, b2d, a_log.contiguous(), dt_bias.contiguous(), g, beta, n, heads, a2d.stride(0), b2d.stride(0),
            BLOCK=GATES_BLOCK, num_warps=4, enable_fp_fusion=False, **dependent_launch_kwargs(a.device))
    return g.reshape(a.shape), beta.reshape(b.shape)


def _forward(a, b, a_log, dt_bias):
    if a.dtype != torch.float64 and b.dtype != torch.float64 and \
            select("gated_delta_gates", a, dtypes=(torch.bfloat16, torch.float16, torch.float32)) != "reference":
        return gated_delta_gates_triton(a, b, a_log, dt_bias)
    return gated_delta_gates_reference(a, b, a_log, dt_bias)


class _GatesFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, a_log, dt_bias):
        g, beta = _forward(a, b, a_log, dt_bias)
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
    return _forward(a, b, a_log, dt_bias)
