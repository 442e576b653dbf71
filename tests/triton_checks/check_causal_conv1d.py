"""The causal conv1d's Triton kernels (tests/triton_checks: the interpreter on CPU, or a GPU)
against the reference; the rollout form bitwise equal to the training forward."""

import random
import sys
from pathlib import Path

import pytest
import torch

# pytest's importlib mode does not put this folder on sys.path; importing the shared helpers
# also applies their skip rule (conftest.py patches the interpreter's tl.dot)
sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, close, ref  # noqa: E402

from vexact_models.conformance.hybrid_invariance import conv_by_steps, packed_cu, random_steps  # noqa: E402
from vexact_models.kernels import causal_conv1d, conv_state_update  # noqa: E402
from vexact_models.kernels.causal_conv1d import conv_state_update_reference  # noqa: E402

LENS = [9, 1, 20, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_forward_and_rollout(dtype):
    x = torch.randn(sum(LENS), 48, device=DEVICE).to(dtype)
    w, b = (torch.randn(48, 4, device=DEVICE) / 2).to(dtype), torch.randn(48, device=DEVICE).to(dtype)
    cu = packed_cu(LENS, DEVICE)
    for bias in (None, b):
        for activation in ("silu", None):
            train = causal_conv1d(x, w, bias, cu, max(LENS), activation)
            close(train, ref(causal_conv1d, x, w, bias, cu, max(LENS), activation), 1e-6 if dtype == torch.float32 else 1e-2)
        train = causal_conv1d(x, w, bias, cu, max(LENS))
        for seed in range(2):
            steps = random_steps(LENS, random.Random(seed))
            assert torch.equal(conv_by_steps(x, w, bias, LENS, steps), train)
    wide = torch.randn(sum(LENS), 2 * 1100, device=DEVICE).to(dtype)[:, 7:1107]  # a row-strided view, 2 channel blocks
    w2 = torch.randn(1100, 4, device=DEVICE).to(dtype)
    close(causal_conv1d(wide, w2, None, cu, max(LENS)), ref(causal_conv1d, wide.contiguous(), w2, None, cu, max(LENS)),
          1e-6 if dtype == torch.float32 else 1e-2)


def test_conv_state_update_matches_reference():
    x = torch.randn(10, 40, device=DEVICE)
    state = torch.randn(5, 3, 40, device=DEVICE)
    cu, idx = packed_cu([1, 6, 0, 2, 1], DEVICE), torch.tensor([4, 0, 2, -1, 1], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([1, 0, 7, 3, 9], dtype=torch.int32, device=DEVICE)
    want = state.cpu().clone()
    conv_state_update_reference(x.cpu(), cu.cpu(), want, idx.cpu(), ctx.cpu())
    conv_state_update(x, cu, state, idx, ctx)
    assert torch.equal(state.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_backward(dtype, monkeypatch):
    """The backward against float64 autograd of the convolution; sequences over several backward
    programs (`BWD_TOKENS` cut to 8 tokens a program here), so partial weight gradients add up."""
    import importlib

    monkeypatch.setattr(importlib.import_module("vexact_models.kernels.causal_conv1d_backward"), "BWD_TOKENS", 8)
    lens = [6, 1, 17]
    x = torch.randn(sum(lens), 40, device=DEVICE).to(dtype).requires_grad_()
    w = (torch.randn(40, 4, device=DEVICE) / 2).to(dtype).requires_grad_()
    b = torch.randn(40, device=DEVICE).to(dtype).requires_grad_()
    g = torch.randn(sum(lens), 40, device=DEVICE).to(dtype)
    cu = packed_cu(lens, DEVICE)
    got = torch.autograd.grad(causal_conv1d(x, w, b, cu, max(lens)), (x, w, b), g)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    want_out = torch.cat([torch.nn.functional.conv1d(xd[s:e].T[None], wd[:, None], bd, padding=3, groups=40)[0, :, :e - s].T
                          for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    want = torch.autograd.grad(torch.nn.functional.silu(want_out), (xd, wd, bd), g.double())
    for a, e in zip(got, want):
        assert a.dtype == dtype
        close(a, e, 1e-5 if dtype == torch.float32 else 2e-2)
