import pytest
import torch

from vexact_models.kernels import add_rms_norm, rms_norm

from ..conftest import rel_err


def _ref(x, w, eps):
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("shape", [(13, 64), (5, 4, 16), (3, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rms_norm_matches_float64(shape, dtype):
    x = torch.randn(shape).to(dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    out = rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, _ref(x, w, 1e-6)) < {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]


def test_rms_norm_matches_hf_in_bf16_bitwise():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    hf = Qwen3RMSNorm(64, eps=1e-6).bfloat16()
    with torch.no_grad():
        hf.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(40, 64).bfloat16()
    # same rounding points as HF (fp32 statistics, cast, multiply by the weight in bf16)
    assert rel_err(rms_norm(x, hf.weight.detach(), 1e-6), hf(x).detach()) < 4e-3


def test_rms_norm_rows_invariant_to_batch():
    x = torch.randn(64, 5000)
    w = torch.rand(5000)
    single = torch.cat([rms_norm(x[i:i + 1], w, 1e-6) for i in range(64)])
    for m in (1, 2, 3, 17, 64):
        assert torch.equal(rms_norm(x[:m], w, 1e-6), single[:m])


def test_rms_norm_backward_matches_autograd():
    x = torch.randn(6, 3, 32, dtype=torch.float64, requires_grad=True)
    w = torch.rand(32, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 3, 32, dtype=torch.float64)
    got = torch.autograd.grad(rms_norm(x, w, 1e-5), (x, w), g)
    want = torch.autograd.grad(_ref(x, w, 1e-5), (x, w), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_rms_norm_weight_shape_error():
    with pytest.raises(ValueError, match=r"weight shape \(8,\) must be \(16,\)"):
        rms_norm(torch.randn(2, 16), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm_bitwise(dtype):
    x, r = torch.randn(9, 4, 48).to(dtype), torch.randn(9, 4, 48).to(dtype)
    w = (torch.rand(48) + 0.5).to(dtype)
    normed, summed = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, x + r)
    assert torch.equal(normed, rms_norm(x + r, w, 1e-6))
    single = torch.cat([add_rms_norm(x[i:i + 1], r[i:i + 1], w, 1e-6)[0] for i in range(9)])
    assert torch.equal(single, normed)


def test_add_rms_norm_backward_matches_autograd():
    x, r = (torch.randn(5, 32, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.rand(32, dtype=torch.float64, requires_grad=True)
    g_normed, g_summed = torch.randn(5, 32, dtype=torch.float64), torch.randn(5, 32, dtype=torch.float64)
    normed, summed = add_rms_norm(x, r, w, 1e-5)
    got = torch.autograd.grad((normed * g_normed).sum() + (summed * g_summed).sum(), (x, r, w))
    s = x + r
    want = torch.autograd.grad((_ref(s, w, 1e-5) * g_normed).sum() + (s * g_summed).sum(), (x, r, w))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    # only the normed output used (the final norm): the sum gets no gradient of its own
    (gx,) = torch.autograd.grad(add_rms_norm(x, r, w, 1e-5)[0].sum(), (x,))
    (want_x,) = torch.autograd.grad(_ref(x + r, w, 1e-5).sum(), (x,))
    assert torch.allclose(gx, want_x, rtol=1e-10, atol=1e-12)


def test_add_rms_norm_errors():
    with pytest.raises(ValueError, match=r"residual \(2, 8\) torch.float32 must match x \(2, 16\)"):
        add_rms_norm(torch.randn(2, 16), torch.randn(2, 8), torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match=r"weight shape \(8,\) must be \(16,\)"):
        add_rms_norm(torch.randn(2, 16), torch.randn(2, 16), torch.ones(8), 1e-6)


def test_norm_launch_tile_is_norm_tile_by_default_and_checks_a_given_tile():
    """The tile a sweep passes (`benchmarks/investigations/row_kernels.py`) keeps BLOCK_N and is checked, with
    the op, the value and the limit in the message, before anything needs Triton or a GPU."""
    from vexact_models.kernels.rms_norm import norm_launch_tile, norm_tile, rms_norm_triton

    for n in (40, 128, 1024, 4096):
        assert norm_launch_tile("rms_norm", n, None) == norm_tile(n)
        assert norm_launch_tile("rms_norm", n, (2, 1)) == (norm_tile(n)[0], 2, 1)
    with pytest.raises(ValueError, match="rms_norm: tile rows=128 must be a power of two from 1 to 64"):
        norm_launch_tile("rms_norm", 128, (128, 4))
    with pytest.raises(ValueError, match="rms_norm: tile rows=0 must be a power of two"):
        rms_norm_triton(torch.randn(2, 8), torch.ones(8), 1e-6, tile=(0, 4))
    with pytest.raises(ValueError, match="rms_norm: num_warps=5 must be 1, 2, 4 or 8"):
        rms_norm_triton(torch.randn(2, 8), torch.ones(8), 1e-6, tile=(2, 5))


def _ref_centred(x, w, eps):
    return _ref(x, 1.0 + w.double(), eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_zero_centred_rms_norm_matches_float64_and_transformers(dtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    x, w = torch.randn(9, 4, 48).to(dtype), (torch.randn(48) / 4).to(dtype)
    out = rms_norm(x, w, 1e-6, zero_centred=True)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, _ref_centred(x, w, 1e-6)) < {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    hf = Qwen3NextRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
    # HF's rounding points (fp32 normed times fp32 1 + w, rounded once; HF computes fp64 in fp32 too):
    # its bf16 result to within bf16's own step, its fp32 result to fp32 rounding
    assert rel_err(out, hf(x).detach()) < {torch.float64: 1e-6, torch.float32: 1e-6, torch.bfloat16: 4e-3}[dtype]
    assert not torch.equal(out, rms_norm(x, w, 1e-6))  # the option is not ignored


def test_zero_centred_add_rms_norm_rows_invariant_and_the_separate_ops():
    x, r, w = torch.randn(33, 96).bfloat16(), torch.randn(33, 96).bfloat16(), (torch.randn(96) / 4).bfloat16()
    normed, summed = add_rms_norm(x, r, w, 1e-6, zero_centred=True)
    assert torch.equal(normed, rms_norm(x + r, w, 1e-6, zero_centred=True))
    single = torch.cat([rms_norm(summed[i:i + 1], w, 1e-6, zero_centred=True) for i in range(33)])
    assert torch.equal(single, normed)


def test_zero_centred_backward_matches_autograd():
    x, r = (torch.randn(6, 32, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = (torch.randn(32, dtype=torch.float64) / 4).requires_grad_()
    g = torch.randn(6, 32, dtype=torch.float64)
    got = torch.autograd.grad(rms_norm(x, w, 1e-5, zero_centred=True), (x, w), g)
    want = torch.autograd.grad(_ref_centred(x, w, 1e-5), (x, w), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    normed, summed = add_rms_norm(x, r, w, 1e-5, zero_centred=True)
    got = torch.autograd.grad((normed * g).sum() + summed.sum(), (x, r, w))
    want = torch.autograd.grad((_ref_centred(x + r, w, 1e-5) * g).sum() + (x + r).sum(), (x, r, w))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    wb = w.detach().bfloat16().requires_grad_()
    (gw,) = torch.autograd.grad(rms_norm(x.detach().bfloat16(), wb, 1e-5, zero_centred=True).sum(), (wb,))
    assert gw.dtype == torch.bfloat16
