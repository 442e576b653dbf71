"""gated_delta_gates: transformers' g and beta (torch path), position-independent, differentiable."""

import pytest
import torch
import torch.nn.functional as F

from vexact_models.kernels import gated_delta_gates


def stock(a, b, a_log, dt_bias):
    """transformers' Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet lines."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_stock(dtype):
    torch.manual_seed(0)
    a, b = (torch.randn(300, 8) * 12).to(dtype), (torch.randn(300, 8) * 6).to(dtype)
    a_log, dt_bias = torch.randn(8).to(dtype), torch.randn(8).to(dtype)
    g, beta = gated_delta_gates(a, b, a_log, dt_bias)
    g_want, beta_want = stock(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert ((g - g_want).abs() / g_want.abs()).max() < 1e-6  # relative, also where softplus is tiny
    assert (beta.float() - beta_want.float()).abs().max() <= (1e-7 if dtype == torch.float32 else 4e-3)


def test_a_row_does_not_depend_on_the_batch():
    """torch's CPU exp/sigmoid round a vectorised body and a scalar tail differently; these gates
    give a token the same bits alone and at any place in a batch."""
    torch.manual_seed(1)
    a, b = torch.randn(67, 5) * 8, torch.randn(67, 5) * 8
    a_log, dt_bias = torch.randn(5), torch.randn(5)
    g, beta = gated_delta_gates(a, b, a_log, dt_bias)
    for i in (0, 13, 66):
        g1, beta1 = gated_delta_gates(a[i:i + 1], b[i:i + 1], a_log, dt_bias)
        assert torch.equal(g1[0], g[i]) and torch.equal(beta1[0], beta[i])


def test_gradients():
    torch.manual_seed(2)
    inputs = [torch.randn(9, 3, dtype=torch.float64) * 4, torch.randn(9, 3, dtype=torch.float64),
              torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    inputs[0][0, 0] = 30.0  # past softplus's threshold
    assert torch.autograd.gradcheck(gated_delta_gates, [t.requires_grad_() for t in inputs])


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"a \(4, 3\) and b \(4, 2\)"):
        gated_delta_gates(torch.zeros(4, 3), torch.zeros(4, 2), torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"dt_bias \(2,\)"):
        gated_delta_gates(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(3), torch.zeros(2))
