"""`kernels.logit_softcap` (Gemma's final logit soft cap) on the reference backend, and the LM
head's logits and `token_logprobs` with it: the sampler's path bitwise, gradients as autograd's."""

import math

import pytest
import torch

from vexact_models.kernels import gather_logprobs, linear, lm_head_logits, logit_softcap, token_logprobs

from ..conftest import rel_err


def _wide_logits(rows: int = 7, cols: int = 600, dtype=torch.float32) -> torch.Tensor:
    """Logits from 1e-6 to 3e3 in magnitude, both signs: both branches of the kernel's tanh
    (|x / cap| below and above 1/4) and saturation."""
    return (torch.randn(rows, cols) * torch.logspace(-6, 3.5, cols)).to(dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 6e-7)])
@pytest.mark.parametrize("cap", [30.0, 1.0])
def test_logit_softcap_matches_tanh_elementwise(dtype, tol, cap):
    """Every element within `tol` of ``cap * tanh(x / cap)`` in float64, relative to itself (small
    values too: no cancellation near 0, the Taylor branch)."""
    x = _wide_logits(dtype=dtype)
    got = logit_softcap(x, cap)
    want = cap * torch.tanh(x.double() / cap)
    assert got.dtype == dtype
    assert float(((got.double() - want).abs() / want.abs().clamp_min(1e-300)).max()) < tol
    assert float(got.abs().max()) <= cap


def test_logit_softcap_is_position_independent():
    """A row alone, a slice of columns, and the whole tensor give each element the same bits."""
    x = _wide_logits(64, 1031)
    full = logit_softcap(x, 30.0)
    for i in (0, 17, 63):
        assert torch.equal(logit_softcap(x[i:i + 1], 30.0)[0], full[i])
    assert torch.equal(logit_softcap(x[:, 5:9], 30.0), full[:, 5:9])


def test_logit_softcap_special_values():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    out = logit_softcap(x, 30.0)
    assert out[:2].tolist() == [30.0, -30.0] and math.isnan(out[2]) and out[3:].tolist() == [0.0, 0.0]


def test_logit_softcap_backward_matches_autograd():
    x = (_wide_logits(5, 40, torch.float64) / 50).requires_grad_()
    g = torch.randn(5, 40, dtype=torch.float64)
    (got,) = torch.autograd.grad(logit_softcap(x, 3.0), x, g)
    (want,) = torch.autograd.grad(3.0 * torch.tanh(x / 3.0), x, g)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan"), True, "30"])
def test_logit_softcap_rejects_bad_caps(cap):
    with pytest.raises(ValueError, match=r"soft cap must be a finite number > 0, got"):
        logit_softcap(torch.randn(2, 3), cap)
    with pytest.raises(ValueError, match="token_logprobs: the soft cap"):
        token_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([1, 2]), softcap=cap)


def test_logit_softcap_rejects_low_precision_logits():
    with pytest.raises(ValueError, match=r"logits must be fp32.*bfloat16"):
        logit_softcap(torch.randn(2, 3).bfloat16(), 30.0)


def test_capped_token_logprobs_equal_the_sampler_path_bitwise():
    """`token_logprobs(softcap=...)` == ``gather_logprobs(lm_head_logits(row))`` row by row (what
    the rollout computes for a sampled token), at any chunking; `lm_head_logits` is `linear`
    then the cap; the cap changes the result."""
    h, w = torch.randn(37, 64), torch.randn(300, 64) / 2
    t = torch.randint(0, 300, (37,))
    logits = lm_head_logits(h, w, 2.0)
    assert torch.equal(logits, logit_softcap(linear(h, w, out_dtype=torch.float32), 2.0))
    sampler = torch.cat([gather_logprobs(lm_head_logits(h[i:i + 1], w, 2.0), t[i:i + 1], 0.7) for i in range(37)])
    for chunk in (1, 5, 512):
        assert torch.equal(token_logprobs(h, w, t, 0.7, chunk_tokens=chunk, softcap=2.0), sampler)
    assert not torch.equal(token_logprobs(h, w, t, 0.7), sampler)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_capped_token_logprobs_gradients_match_autograd(dtype):
    """The backward through the cap (recomputed logits, capped, times its derivative) against
    autograd through ``log_softmax(cap * tanh(h W^T / cap) / T)`` in float64 (the bounds of the
    uncapped path: its fp64 logprobs are 2e-7 from float64 torch)."""
    h = torch.randn(23, 32, dtype=dtype, requires_grad=True)
    w = (torch.randn(200, 32, dtype=dtype) / 2).requires_grad_()
    t = torch.randint(0, 200, (23,))
    g = torch.randn(23, dtype=torch.float64)
    got = torch.autograd.grad(token_logprobs(h, w, t, 0.8, chunk_tokens=7, softcap=3.0), (h, w), g.to(dtype))
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp = torch.log_softmax(3.0 * torch.tanh(hd @ wd.T / 3.0) / 0.8, -1)[torch.arange(23), t]
    want = torch.autograd.grad(lp, (hd, wd), g)
    for a, b in zip(got, want):
        assert rel_err(a, b) < (1e-6 if dtype == torch.float64 else 1e-5)  # as without the cap: 2e-8 in fp64
