import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

from vexact_models.kernels import gated_rms_norm

from ..conftest import rel_err


def _ref(x, z, w, eps):
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * torch.nn.functional.silu(z.double())


@pytest.mark.parametrize("shape", [(13, 64), (5, 4, 16), (3, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gated_rms_norm_matches_float64(shape, dtype):
    x, z = torch.randn(shape).to(dtype), (torch.randn(shape) * 3).to(dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    out = gated_rms_norm(x, z, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, _ref(x, z, w, 1e-6)) < {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype):
    hf = Qwen3NextRMSNormGated(128, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(128) + 0.5)
    x, z = torch.randn(40, 128).to(dtype), (torch.randn(40, 128) * 2).to(dtype)
    want = hf(x, z).detach()
    got = gated_rms_norm(x, z, hf.weight.detach(), 1e-6)
    # HF's rounding points: fp32 agrees to fp32 rounding, bf16 within one bf16 step of HF's bf16
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 4e-3)


def test_gated_rms_norm_rows_invariant_to_batch():
    x, z = torch.randn(64, 3, 128), torch.randn(64, 3, 128)
    w = torch.rand(128)
    single = torch.cat([gated_rms_norm(x[i:i + 1], z[i:i + 1], w, 1e-6) for i in range(64)])
    for m in (1, 2, 17, 64):
        assert torch.equal(gated_rms_norm(x[:m], z[:m], w, 1e-6), single[:m])


def test_gated_rms_norm_backward_matches_autograd():
    x = torch.randn(6, 3, 32, dtype=torch.float64, requires_grad=True)
    z = torch.randn(6, 3, 32, dtype=torch.float64, requires_grad=True)
    w = torch.rand(32, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 3, 32, dtype=torch.float64)
    got = torch.autograd.grad(gated_rms_norm(x, z, w, 1e-5), (x, z, w), g)
    want = torch.autograd.grad(_ref(x, z, w, 1e-5), (x, z, w), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_gated_rms_norm_errors():
    with pytest.raises(ValueError, match=r"weight \(8,\) torch.float32 must be \(16,\) torch.float32"):
        gated_rms_norm(torch.randn(2, 16), torch.randn(2, 16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"gate \(2, 8\) torch.float32 must match x \(2, 16\)"):
        gated_rms_norm(torch.randn(2, 16), torch.randn(2, 8), torch.ones(16), 1e-6)
