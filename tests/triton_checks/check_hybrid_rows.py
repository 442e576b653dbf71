"""The gated-DeltaNet hybrids' row and element-wise kernels (gated RMSNorm, the sigmoid gate,
the zero-centred RMSNorm, partial rotary) against their references; see check_triton_kernels."""

import sys
from pathlib import Path

import pytest
import torch

# pytest's importlib mode does not put this folder on sys.path; importing the shared helpers
# also applies their skip rule (conftest.py patches the interpreter's tl.dot)
sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, close, rand, ref  # noqa: E402

from vexact_models.kernels import gated_rms_norm  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(dtype):
    x, z, w = rand(9, 3, 128).to(dtype), (rand(9, 3, 128) * 3).to(dtype), (rand(128, kind="u") + 0.5).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    close(gated_rms_norm(x, z, w, 1e-6), ref(gated_rms_norm, x, z, w, 1e-6), tol)
    wide = rand(9, 2 * 3 * 128).to(dtype)[:, 5:5 + 3 * 128].unflatten(1, (3, 128))  # row-strided views
    close(gated_rms_norm(wide, z, w, 1e-6), ref(gated_rms_norm, wide.contiguous(), z, w, 1e-6), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_backward(dtype):
    x, z = rand(70, 128).to(dtype).requires_grad_(), (rand(70, 128) * 2).to(dtype).requires_grad_()
    w = (rand(128, kind="u") + 0.5).to(dtype).requires_grad_()
    g = rand(70, 128).to(dtype)
    got = torch.autograd.grad(gated_rms_norm(x, z, w, 1e-6), (x, z, w), g)
    xd, zd, wd = (t.detach().double().requires_grad_() for t in (x, z, w))
    out = wd * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.nn.functional.silu(zd)
    want = torch.autograd.grad(out, (xd, zd, wd), g.double())
    for a, b in zip(got, want):
        assert a.dtype == dtype
        close(a, b, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm(dtype):
    from vexact_models.kernels import add_rms_norm, rms_norm

    tol = 1e-5 if dtype == torch.float32 else 1e-2
    x, r, w = rand(7, 3, 256).to(dtype), rand(7, 3, 256).to(dtype), (rand(256) / 4).to(dtype)
    close(rms_norm(x, w, 1e-6, zero_centred=True), ref(rms_norm, x, w, 1e-6, zero_centred=True), tol)
    heads = rand(7, 5, 256).to(dtype)[:, 1:4]  # per-head rows of a strided view (the q/k norms)
    close(rms_norm(heads, w, 1e-6, zero_centred=True), ref(rms_norm, heads.contiguous(), w, 1e-6, zero_centred=True), tol)
    normed, summed = add_rms_norm(x, r, w, 1e-6, zero_centred=True)
    close(normed, ref(rms_norm, x + r, w, 1e-6, zero_centred=True), tol)
    if dtype == torch.bfloat16:  # the plain norm rounds the normalized row first: other bits
        assert not torch.equal(rms_norm(x, w + 1, 1e-6), rms_norm(x, w, 1e-6, zero_centred=True))
    xg, wg = rand(70, 256).to(dtype).requires_grad_(), (rand(256) / 4).to(dtype).requires_grad_()
    g = rand(70, 256).to(dtype)
    got = torch.autograd.grad(rms_norm(xg, wg, 1e-6, zero_centred=True), (xg, wg), g)
    xd, wd = (t.detach().double().requires_grad_() for t in (xg, wg))
    want = torch.autograd.grad(xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + wd), (xd, wd), g.double())
    for a, b in zip(got, want):
        assert a.dtype == dtype
        close(a, b, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate(dtype):
    from vexact_models.kernels import sigmoid_gate
    from vexact_models.kernels.sigmoid_gate import sigmoid_gate_backward

    q_proj = (rand(9, 4, 2 * 256) * 3).to(dtype)  # per head: query, then gate (HF's gated q_proj)
    x, gate = rand(9, 4, 256).to(dtype), q_proj[..., 256:]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    close(sigmoid_gate(x, gate), ref(sigmoid_gate, x, gate.contiguous()), tol)
    close(sigmoid_gate(x.reshape(9, -1), gate.reshape(9, -1)), ref(sigmoid_gate, x, gate.contiguous()).reshape(9, -1), tol)
    h, g = rand(9, 2000).to(dtype), rand(9, 1).to(dtype)  # the shared expert's gate, two column blocks
    close(sigmoid_gate(h, g), ref(sigmoid_gate, h, g), tol)
    xg, gg = x.clone().requires_grad_(), gate.clone().requires_grad_()
    dy = rand(9, 4, 256).to(dtype)
    got = torch.autograd.grad(sigmoid_gate(xg, gg), (xg, gg), dy)
    want = ref(sigmoid_gate_backward, x.double(), gate.double(), dy.double())
    for a, b in zip(got, want):
        close(a, b, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary(dtype):
    """Head dim 256, the first 64 dims rotated (Qwen3-Next, Qwen3.5), forward and backward."""
    from vexact_models.kernels import apply_rotary, rope_table

    cos, sin = (t.to(DEVICE) for t in rope_table(1.0 / (1e4 ** (torch.arange(0, 64, 2) / 64)), 500))
    x, pos = rand(6, 3, 256).to(dtype), torch.randint(0, 500, (6,), device=DEVICE)
    out = apply_rotary(x, pos, cos, sin)
    close(out, ref(apply_rotary, x, pos, cos, sin), 1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(out[..., 64:], x[..., 64:])
    view = rand(6, 5, 256).to(dtype)[:, 1:4]  # heads of a fused projection: a strided view
    close(apply_rotary(view, pos, cos, sin), ref(apply_rotary, view.contiguous(), pos, cos, sin),
          1e-6 if dtype == torch.float32 else 1e-2)
    xg, g = x.clone().requires_grad_(), rand(6, 3, 256).to(dtype)
    (got,) = torch.autograd.grad(apply_rotary(xg, pos, cos, sin), (xg,), g)
    close(got, ref(apply_rotary, g, pos, cos, -sin), 1e-6 if dtype == torch.float32 else 1e-2)
