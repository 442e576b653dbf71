"""`exact_math`'s ``exp`` and ``log`` as Triton functions, bitwise the same as the torch reference.

`exact_math.exp` and `exact_math.log` are float64 range reductions and polynomials built only from
IEEE-exact operations (``+ - * /``, comparisons, exponent-field bit work), so a kernel that performs
the same operations in the same order on float64 values gets the same bits on any device. Three
things make the Triton code below equal to the torch code, and each is deliberate:

- every constant is a float64 tensor (`_f64`): a Python float in Triton arithmetic becomes an fp32
  constant first, which would round ``1/3`` or ``log2(e)`` before the product;
- kernels calling these helpers launch with ``enable_fp_fusion=False``: the reference rounds each
  ``poly * r`` before adding the coefficient, and a fused multiply-add would not;
- torch's ``round`` (half to even) is the add-and-subtract of ``1.5 * 2**52``, exact in round-to-
  nearest for ``|t| < 2**51`` (here ``|t| <= 800 log2(e)``); ``frexp`` and ``2**n`` are exponent-
  field bit work on the int64 view, as the reference builds ``2**n``.

`log64` covers what `exact_math.log` covers except subnormal inputs (below ``2**-1022``), whose
``frexp`` needs a normalisation the callers here never meet (they take logs of values >= 1).
Both are checked bitwise against the reference by ``tests/triton_checks/check_gated_delta_gates.py``
(interpreter and GPU).
"""

from __future__ import annotations

from ._triton import tl, triton


@triton.jit
def _f64(value: tl.constexpr):
    """`value` as a float64 scalar (not through an fp32 constant)."""
    return tl.full([], value, tl.float64)


@triton.jit
def exp64(x):
    """`exact_math.exp` of `x` (any float dtype), in float64; the caller rounds to its dtype."""
    xd = x.to(tl.float64)
    xd = tl.where(xd < -800.0, _f64(-800.0), tl.where(xd > 800.0, _f64(800.0), xd))  # NaN stays NaN
    t = xd * _f64(1.4426950408889634)
    n = (t + _f64(6755399441055744.0)) - _f64(6755399441055744.0)  # torch.round: 1.5 * 2**52 in and out
    r = xd - n * _f64(0.6931471805599453)
    poly = tl.zeros_like(r) + _f64(2.08767569878681e-09)  # 1/k! for k = 12 .. 0 (exact_math._EXP_COEFFS)
    poly = poly * r + _f64(2.505210838544172e-08)
    poly = poly * r + _f64(2.755731922398589e-07)
    poly = poly * r + _f64(2.7557319223985893e-06)
    poly = poly * r + _f64(2.48015873015873e-05)
    poly = poly * r + _f64(0.0001984126984126984)
    poly = poly * r + _f64(0.001388888888888889)
    poly = poly * r + _f64(0.008333333333333333)
    poly = poly * r + _f64(0.041666666666666664)
    poly = poly * r + _f64(0.16666666666666666)
    poly = poly * r + _f64(0.5)
    poly = poly * r + _f64(1.0)
    poly = poly * r + _f64(1.0)
    ni = n.to(tl.int64)
    half = ni >> 1  # floor(n / 2)
    scale_a = ((half + 1023) << 52).to(tl.float64, bitcast=True)
    scale_b = ((ni - half + 1023) << 52).to(tl.float64, bitcast=True)
    return poly * scale_a * scale_b


@triton.jit
def log64(u):
    """`exact_math.log` of float64 `u` (not subnormal), in float64. The sign bit is dropped from the
    mantissa: a negative `u` gives NaN below, as the reference's does."""
    bits = u.to(tl.int64, bitcast=True)
    exponent = ((bits >> 52) & 0x7FF) - 1022  # frexp: u = mantissa * 2**exponent, mantissa in [0.5, 1)
    mantissa = ((bits & 0xFFFFFFFFFFFFF) | (1022 << 52)).to(tl.float64, bitcast=True)
    small = mantissa < _f64(0.7071067811865476)
    mantissa = tl.where(small, mantissa * 2.0, mantissa)
    e = exponent.to(tl.float64) - small.to(tl.float64)
    s = (mantissa - 1.0) / (mantissa + 1.0)
    s2 = s * s
    poly = tl.zeros_like(s) + _f64(0.04)  # 1/k for k = 25, 23, .. 1 (exact_math._ATANH_COEFFS)
    poly = poly * s2 + _f64(0.043478260869565216)
    poly = poly * s2 + _f64(0.047619047619047616)
    poly = poly * s2 + _f64(0.05263157894736842)
    poly = poly * s2 + _f64(0.058823529411764705)
    poly = poly * s2 + _f64(0.06666666666666667)
    poly = poly * s2 + _f64(0.07692307692307693)
    poly = poly * s2 + _f64(0.09090909090909091)
    poly = poly * s2 + _f64(0.1111111111111111)
    poly = poly * s2 + _f64(0.14285714285714285)
    poly = poly * s2 + _f64(0.2)
    poly = poly * s2 + _f64(0.3333333333333333)
    poly = poly * s2 + _f64(1.0)
    result = 2.0 * s * poly + e * _f64(0.6931471805599453)
    result = tl.where(u == 0.0, -float("inf"), result)
    result = tl.where(u == float("inf"), float("inf"), result)
    result = tl.where(u < 0.0, float("nan"), result)
    return tl.where(u != u, u, result)  # NaN in, NaN out (the bit work above would make it finite)
