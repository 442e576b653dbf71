import pytest
import torch

from vexact_models.kernels import rms_norm

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
