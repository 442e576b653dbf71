import pytest
import torch

from vexact_models.kernels.logprob_grad import logprob_grad


def _case(rows=6, vocab=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 4
    temps = torch.tensor([1.0, 0.5, 2.0, 0.75, 1.3, 0.9], dtype=torch.float64)[:rows]
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    grad = torch.randn(rows, generator=gen, dtype=torch.float64)
    return logits, temps, targets, grad


def test_logprob_grad_matches_autograd_of_log_softmax():
    logits, temps, targets, grad = _case()
    x = logits.clone().requires_grad_()
    logp = torch.log_softmax(x / temps[:, None], -1)[torch.arange(6), targets]
    (want,) = torch.autograd.grad(logp, x, grad)
    lse = torch.logsumexp(logits / temps[:, None], -1)
    got64 = logprob_grad(logits, lse, targets, temps, grad)
    assert got64.dtype == torch.float64 and torch.allclose(got64, want, rtol=1e-12, atol=1e-14)
    got32 = logprob_grad(logits.float(), lse.float(), targets, temps.float(), grad.float(), out_dtype=torch.bfloat16)
    assert got32.dtype == torch.bfloat16
    assert torch.allclose(got32.double(), want, rtol=1e-2, atol=1e-3)


def test_logprob_grad_rejects_bad_shapes():
    logits, temps, targets, grad = _case()
    lse = torch.logsumexp(logits / temps[:, None], -1)
    with pytest.raises(ValueError, match=r"targets must have shape \(6,\), got \(5,\)"):
        logprob_grad(logits, lse, targets[:5], temps, grad)
    with pytest.raises(ValueError, match="unit column stride"):
        logprob_grad(logits.t(), lse, targets, temps, grad)
