"""The gated-DeltaNet gates' Triton kernel (`kernels.gated_delta_gates`, with `exact_math_triton`'s
float64 exp and log) against the torch reference, bitwise: the kernel performs the reference's
IEEE operations in its order, so the bits agree on CPU (interpreter) and GPU alike; see
check_triton_kernels."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, rand  # noqa: E402

from vexact_models.kernels import exact_math  # noqa: E402
from vexact_models.kernels._triton import tl, triton  # noqa: E402
from vexact_models.kernels.exact_math_triton import exp64, log64  # noqa: E402
from vexact_models.kernels.gated_delta_gates import gated_delta_gates_reference, gated_delta_gates_triton  # noqa: E402


@triton.jit
def _exp_log_kernel(x_ptr, e_ptr, l_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    tl.store(e_ptr + offs, exp64(x), mask=mask)
    tl.store(l_ptr + offs, log64(x), mask=mask)


def test_exp64_and_log64_are_exact_maths_bits():
    """`exact_math_triton`'s exp and log over float64 values from 1e-300 to 1e300 of both signs,
    exp's clamp and overflow, halfway cases of the rounding of ``x log2(e)``, zeros, infinities
    and NaN: the bits of `exact_math.exp` / `exact_math.log` (log's subnormal inputs excluded)."""
    torch.manual_seed(0)
    mags = torch.logspace(-300, 300, 3001, dtype=torch.float64)
    near = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5], dtype=torch.float64) / 1.4426950408889634  # n rounds half to even
    special = torch.tensor([0.0, -0.0, 1.0, 2.0, 709.0, 710.0, 800.0, 801.0, -745.0, -800.0, -1e308, float("inf"),
                            float("-inf"), float("nan")], dtype=torch.float64)
    x = torch.cat([mags, -mags, torch.randn(4000, dtype=torch.float64) * 30, near, special])
    xd = x.to(DEVICE)
    e, lg = torch.empty_like(xd), torch.empty_like(xd)
    _exp_log_kernel[(triton.cdiv(x.numel(), 1024),)](xd, e, lg, x.numel(), BLOCK=1024, enable_fp_fusion=False)
    want_e, want_l = exact_math.exp(x), exact_math.log(x)
    assert torch.equal(e.cpu().view(torch.int64)[~x.isnan()], want_e.view(torch.int64)[~x.isnan()])
    assert torch.equal(lg.cpu().view(torch.int64)[~x.isnan()], want_l.view(torch.int64)[~x.isnan()])
    assert e.cpu()[x.isnan()].isnan().all() and lg.cpu()[x.isnan()].isnan().all()


def hard_values(dtype: torch.dtype) -> torch.Tensor:
    """``[600, 8]`` projections over every branch: tiny and huge magnitudes, softplus's threshold
    (20) and both sides of it, exp's clamp (+-800 after the bias), exact zeros and integers."""
    torch.manual_seed(0)
    x = torch.randn(600, 8) * torch.logspace(-8, 2.5, 600)[:, None]
    x[:8] = torch.tensor([0.0, -0.0, 20.0, -20.0, 19.99, 88.0, -104.0, 1.0])[:, None]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates_kernel_equals_the_reference_bitwise(dtype):
    a, b = hard_values(dtype), hard_values(dtype).flip(0) * 3
    a_log = torch.tensor([-9.0, -0.5, 0.0, 0.3, 1.7, 2.77, 4.0, 6.5])
    dt_bias = torch.tensor([-3.0, 0.0, 0.25, 1.0, 5.0, -0.1, 2.0, 30.0]).to(dtype)
    want_g, want_beta = gated_delta_gates_reference(a, b, a_log, dt_bias)
    g, beta = gated_delta_gates_triton(a.to(DEVICE), b.to(DEVICE), a_log.to(DEVICE), dt_bias.to(DEVICE))
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert torch.equal(g.cpu(), want_g) and torch.equal(beta.cpu(), want_beta)


def test_gates_kernel_reads_projection_views_in_place():
    """a and b as column slices of one fused projection output (the rollout's GEMM group), and
    with extra leading dimensions: the reference's bits, the input's shape."""
    fused = (rand(3, 37, 40) * 6).bfloat16()
    a, b = fused[..., 4:20], fused[..., 24:40]
    a_log, dt_bias = rand(16), rand(16).bfloat16()
    g, beta = gated_delta_gates_triton(a, b, a_log, dt_bias)
    want_g, want_beta = gated_delta_gates_reference(a.cpu(), b.cpu(), a_log.cpu(), dt_bias.cpu())
    assert g.shape == (3, 37, 16) and torch.equal(g.cpu(), want_g) and torch.equal(beta.cpu(), want_beta)
