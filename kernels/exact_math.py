"""Batch-invariant building blocks for the CPU reference backend.

torch's CPU kernels are not batch-invariant in three ways that matter here (measured with torch
2.13 on x86-64, see tests/test_exact_math.py):

- Transcendental functions (``sigmoid``, ``silu``, ``exp2``, ...) run a vectorized (SLEEF)
  body and a scalar tail, which can round differently: an element's result depends on where it
  sits in the tensor, hence on the batch size.
- A reduction with a single output and >= 32768 inputs is split across threads (two-pass), so
  a row summed alone differs from the same row summed among others.
- BLAS GEMM picks kernels by M: rows of ``x @ w.T`` change when only the row count changes.

Everything below is therefore written with operations whose result is fixed by IEEE 754
(+, -, *, /, sqrt, round, frexp, comparisons, max) applied element-wise, and with reductions
shaped so that each output is reduced by the same code over the same number of inputs:

- `exp` / `log`: range reduction + polynomial in float64, rounded once to the output dtype.
- `row_sum`: the last dimension is summed in fixed blocks of `REDUCE_BLOCK`, then the block
  sums are summed; no reduction ever has a single output over >= 32768 inputs.
- `dot`: an element-wise product followed by `row_sum` (a GEMM as per-output reductions).
"""

from __future__ import annotations

import math

import torch

REDUCE_BLOCK = 4096  # < 32768 (torch's GRAIN_SIZE): a single-output reduction stays serial
# Products one `dot_rows` call materialises at most: 4 MiB of fp32 stays in a CPU's caches. With
# 8x as many, fresh pages for every call, the linear reference ran 3 to 12x slower at the tiny
# models' shapes (tests/test_exact_math.py pins that the values do not depend on it).
PRODUCT_ELEMENTS = 1 << 20

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
_EXP_COEFFS = [1.0 / math.factorial(k) for k in range(13)]  # Taylor series of exp, degree 12
_ATANH_COEFFS = [1.0 / k for k in range(1, 26, 2)]  # 1, 1/3, 1/5, ... 1/25


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def exp(x: torch.Tensor) -> torch.Tensor:
    """e**x, element-wise, with a result that depends only on the element's value.

    Accurate to float32 rounding (the float64 polynomial has relative error < 1e-14).
    Returns float32 for float32/bf16/fp16 input and float64 for float64 input.
    """
    out_dtype = _compute_dtype(x)
    xd = x.to(torch.float64, copy=True).clamp_(-800.0, 800.0)  # exp(-800) == 0 and exp(800) == inf in float64
    n = torch.round(xd * _LOG2E)
    r = xd.sub_(n * _LN2)  # |r| <= ln(2)/2
    poly = r * _EXP_COEFFS[12] + _EXP_COEFFS[11]
    for coeff in reversed(_EXP_COEFFS[:11]):  # (in place: the same roundings, fewer allocations)
        poly.mul_(r).add_(coeff)
    # 2**n assembled from its bits; split into two factors so the exponent field never overflows.
    half = torch.div(n, 2, rounding_mode="floor")
    scale_a = half.to(torch.int64).add_(1023).bitwise_left_shift_(52).view(torch.float64)
    scale_b = n.sub_(half).to(torch.int64).add_(1023).bitwise_left_shift_(52).view(torch.float64)
    return poly.mul_(scale_a).mul_(scale_b).to(out_dtype)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log, element-wise, with a result that depends only on the element's value.

    log(0) = -inf, log(inf) = inf, log(negative) = nan. Float32 out for float32/bf16/fp16 input.
    """
    out_dtype = _compute_dtype(x)
    xd = x.double()
    mantissa, exponent = torch.frexp(xd)  # xd = mantissa * 2**exponent, mantissa in [0.5, 1)
    small = mantissa < _SQRT_HALF
    mantissa = torch.where(small, mantissa * 2.0, mantissa)
    exponent = exponent.double() - small.double()
    s = (mantissa - 1.0) / (mantissa + 1.0)  # log(m) = 2 atanh(s), |s| <= 0.172
    s2 = s * s
    poly = torch.full_like(s, _ATANH_COEFFS[-1])
    for coeff in reversed(_ATANH_COEFFS[:-1]):
        poly = poly * s2 + coeff
    result = 2.0 * s * poly + exponent * _LN2
    result = torch.where(xd == 0, float("-inf"), result)
    result = torch.where(torch.isinf(xd) & (xd > 0), float("inf"), result)
    result = torch.where(xd < 0, float("nan"), result)
    return result.to(out_dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e**-x), element-wise and position-independent."""
    return 1.0 / (1.0 + exp(-x))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension; each output's result is independent of the leading dims."""
    n = x.shape[-1]
    if n <= REDUCE_BLOCK:
        return x.sum(-1)
    pad = (-n) % REDUCE_BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    blocks = x.reshape(*x.shape[:-1], -1, REDUCE_BLOCK).sum(-1)
    return blocks.sum(-1)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """Max over the last dimension (max is exact, so any order gives the same result)."""
    return x.amax(-1)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b) over the last dimension, broadcasting the leading dims, computed per output."""
    return row_sum(a * b)


def dot_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dot(x[:, ..., None, :], w[None])``: ``x [M, *lead, K]`` against ``w [*lead, N, K]`` gives
    ``[M, *lead, N]`` (a GEMM ``x . w^T`` per lead index), computed a few rows at a time so that each
    call's product holds at most `PRODUCT_ELEMENTS`: every output is its own reduction, so the
    values do not depend on how the rows are grouped."""
    rows = max(1, PRODUCT_ELEMENTS // max(1, w.numel()))
    out = torch.empty((x.shape[0], *w.shape[:-1]), dtype=torch.result_type(x, w))
    for start in range(0, x.shape[0], rows):
        out[start:start + rows] = dot(x[start:start + rows].unsqueeze(-2), w.unsqueeze(0))
    return out


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) over the last dimension, float32 (float64 for float64 input)."""
    x = x.to(_compute_dtype(x))
    m = row_max(x)
    safe_m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return safe_m + log(row_sum(exp(x - safe_m.unsqueeze(-1))))


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, float32 (float64 for float64 input)."""
    x = x.to(_compute_dtype(x))
    e = exp(x - row_max(x).unsqueeze(-1))
    return e / row_sum(e).unsqueeze(-1)
