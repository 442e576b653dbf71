"""The final logit soft cap's Triton kernel (`kernels.logit_softcap`) against its reference and
float64 tanh, its elements the same bits alone as in a whole tensor, and capped `token_logprobs`
the sampler path's bits; see check_triton_kernels."""

import sys
from pathlib import Path

import torch

# pytest's importlib mode does not put this folder on sys.path; importing the shared helpers
# also applies their skip rule (conftest.py patches the interpreter's tl.dot)
sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, close, rand, ref  # noqa: E402

from vexact_models.kernels import gather_logprobs, lm_head_logits, logit_softcap, token_logprobs  # noqa: E402


def test_logit_softcap_against_reference_and_tanh():
    """Both branches of the kernel's tanh (|x / cap| below and above 1/4), saturation, infinities:
    every element within a few ulp of ``cap * tanh(x / cap)`` and close to the reference."""
    x = rand(5, 1500) * torch.logspace(-6, 3.5, 1500, device=DEVICE)
    x[0, :2] = torch.tensor([float("inf"), float("-inf")])
    for cap in (30.0, 1.0):
        got = logit_softcap(x, cap)
        want = cap * torch.tanh(x.double() / cap)
        assert float(((got.double() - want).abs() / want.abs().clamp_min(1e-300)).max()) < 1e-6
        close(got, ref(logit_softcap, x, cap), 1e-6)
    grad = torch.autograd.grad(logit_softcap(x.requires_grad_(), 3.0), x, torch.ones_like(x))[0]
    close(grad, 1.0 - torch.tanh(x.detach().double() / 3.0) ** 2, 1e-6)


def test_logit_softcap_elements_do_not_depend_on_the_launch():
    """A row alone, an odd slice and the whole tensor (other sizes, other offsets into the
    kernel's blocks) give each element the same bits."""
    x = rand(33, 2051) * 40
    full = logit_softcap(x, 30.0)
    for i in (0, 16, 32):
        assert torch.equal(logit_softcap(x[i:i + 1], 30.0)[0], full[i])
    assert torch.equal(logit_softcap(x[:, 7:1030], 30.0), full[:, 7:1030])


def test_capped_token_logprobs_equal_the_sampler_path_bitwise():
    h, w = rand(40, 64), rand(700, 64) / 2
    t = torch.randint(0, 700, (40,), device=DEVICE)
    sampler = torch.cat([gather_logprobs(lm_head_logits(h[i:i + 1], w, 2.0), t[i:i + 1], 0.7) for i in range(40)])
    for chunk in (1, 16, 512):
        assert torch.equal(token_logprobs(h, w, t, 0.7, chunk_tokens=chunk, softcap=2.0), sampler)
