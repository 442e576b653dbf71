import pytest
import torch

from vexact_models.kernels import gelu_tanh_and_mul

from ..conftest import rel_err


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_matches_torch(dtype):
    """The reference against torch's ``gelu(approximate="tanh") * up`` (HF's gelu_pytorch_tanh),
    over values where tanh saturates both ways (|g| up to 30)."""
    gate = (torch.randn(7, 300) * torch.logspace(-3, 1.5, 300)).to(dtype)
    up = torch.randn(7, 300).to(dtype)
    want = torch.nn.functional.gelu(gate.double(), approximate="tanh") * up.double()
    got = gelu_tanh_and_mul(gate, up)
    assert got.dtype == dtype
    assert rel_err(got, want) < {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]


def test_gelu_tanh_and_mul_rows_are_position_independent():
    gate, up = torch.randn(64, 257), torch.randn(64, 257)
    full = gelu_tanh_and_mul(gate, up)
    for i in (0, 17, 63):
        assert torch.equal(gelu_tanh_and_mul(gate[i:i + 1], up[i:i + 1])[0], full[i])
    assert torch.equal(gelu_tanh_and_mul(gate[:, 5:9], up[:, 5:9]), full[:, 5:9])


def test_gelu_tanh_and_mul_backward_matches_autograd():
    gate = (torch.randn(5, 40, dtype=torch.float64) * 4).requires_grad_()
    up = torch.randn(5, 40, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 40, dtype=torch.float64)
    got = torch.autograd.grad(gelu_tanh_and_mul(gate, up), (gate, up), g)
    want = torch.autograd.grad(torch.nn.functional.gelu(gate, approximate="tanh") * up, (gate, up), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_gelu_tanh_and_mul_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="must match"):
        gelu_tanh_and_mul(torch.randn(2, 4), torch.randn(2, 5))
