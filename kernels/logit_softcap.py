"""logit_softcap: ``cap * tanh(logits / cap)``, the final logit soft-capping of Gemma's LM head
(``config.final_logit_softcapping``), on the head's fp32 logits.

Computed in fp32 (fp64 for fp64): ``y = x / cap``, then ``tanh(y)`` as an odd Taylor polynomial
in ``y`` where ``|y| < 1/4`` (`SMALL`; its first dropped term is below 1e-9 of ``tanh(y)``), else
``1 - 2 / (1 + exp(2|y|))`` with ``y``'s sign (the form `gelu_tanh_and_mul` uses, which loses
the relative accuracy of small ``tanh(y)`` to cancellation: hence the polynomial), times ``cap``.
An infinite logit gives ``+-cap``, a NaN stays NaN.

Invariance contract (docs/design.md rule 5): element-wise, the same expression for every element,
whatever the tensor's size or the element's position; the Triton kernel takes no size
specialization (``do_not_specialize``) and one launch shape. The reference uses `exact_math.exp`
(torch's CPU ``exp``/``tanh`` round by position, a vectorized body and a scalar tail) and plain
IEEE ``+ - * /``. The training forward's logits, `token_logprobs`' chunks and the rollout's
logits (`token_logprobs.lm_head_logits`, the one place each of them gets its logits from) all
apply this op to `linear`'s fp32 rows, so rule 7's equality of the rollout's and the training
logprobs holds with the cap. The backward (rule 8) is ``grad * (1 - (out / cap)**2)`` in torch.
"""

from __future__ import annotations

import math

import torch

from . import exact_math
from ._triton import require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs

BLOCK = 1024  # elements per program
SMALL = 0.25  # |y| below which tanh(y) is the Taylor polynomial
#: Taylor coefficients of tanh(y) / y in powers of y**2 (y**0 .. y**12): 1, -1/3, 2/15, -17/315, ...
TANH_TAYLOR = (1.0, -1.0 / 3.0, 2.0 / 15.0, -17.0 / 315.0, 62.0 / 2835.0, -1382.0 / 155925.0, 21844.0 / 6081075.0)


@triton.jit
def _tanh(y):
    """tanh(y) in fp32: the module docstring's two forms."""
    a = tl.abs(y)
    y2 = y * y
    poly = -1382.0 / 155925.0 + y2 * (21844.0 / 6081075.0)
    poly = 62.0 / 2835.0 + y2 * poly
    poly = -17.0 / 315.0 + y2 * poly
    poly = 2.0 / 15.0 + y2 * poly
    poly = -1.0 / 3.0 + y2 * poly
    poly = 1.0 + y2 * poly
    big = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * a))
    big = tl.where(y < 0, -big, big)
    return tl.where(a < 0.25, y * poly, big)


# n is not specialized: every element comes from the same compiled code whatever the size
@triton.jit(do_not_specialize=["n"])
def _logit_softcap_kernel(x_ptr, out_ptr, n, cap, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _tanh(x / cap) * cap, mask=mask)


def logit_softcap_triton(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """The Triton kernel's forward (no autograd) on contiguous fp32 `logits`."""
    require_triton("logit_softcap")
    out = torch.empty_like(logits)
    n = logits.numel()
    if n:
        _logit_softcap_kernel[(triton.cdiv(n, BLOCK),)](logits, out, n, cap, BLOCK=BLOCK, num_warps=4,
                                                          **dependent_launch_kwargs(logits.device), enable_fp_fusion=True)
    return out


def tanh_reference(y: torch.Tensor) -> torch.Tensor:
    """tanh(y) as the kernel computes it (the module docstring's two forms), position-independent
    on CPU: `exact_math.exp` and IEEE ``+ - * /`` in y's dtype."""
    a = y.abs()
    y2 = y * y
    poly = torch.full_like(y, TANH_TAYLOR[-1])
    for coeff in reversed(TANH_TAYLOR[:-1]):
        poly = coeff + y2 * poly
    big = 1.0 - 2.0 / (1.0 + exact_math.exp(2.0 * a))
    big = torch.where(y < 0, -big, big)
    return torch.where(a < SMALL, y * poly, big)


def logit_softcap_reference(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """The CPU reference: the module docstring's formula in fp32 (fp64 for fp64)."""
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return (tanh_reference(logits.to(compute) / cap) * cap).to(logits.dtype)


class _LogitSoftcapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, cap):
        if select("logit_softcap", logits, dtypes=(torch.float32,)) == "triton":
            out = logit_softcap_triton(logits, cap)
        else:
            out = logit_softcap_reference(logits, cap)
        ctx.save_for_backward(out)
        ctx.cap = cap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (out,) = ctx.saved_tensors
        t = out / ctx.cap
        return grad_out * (1.0 - t * t), None


def check_softcap(cap: object, where: str = "logit_softcap") -> float:
    """`cap` as a float, or a ValueError naming it: a finite number > 0."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"{where}: the soft cap must be a finite number > 0, got {cap!r}")
    return float(cap)


def logit_softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` element-wise, for fp32 (fp64 on the reference backend)
    `logits`; differentiable. `cap` is a finite number > 0 (a ValueError names it otherwise)."""
    cap = check_softcap(cap)
    if logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"logit_softcap: logits must be fp32 (the LM head's fp32 logits), got {logits.dtype}")
    return _LogitSoftcapFunction.apply(logits.contiguous(), cap)
