"""The flash attention backward candidate (`kernels/attention_backward_flash.py`, docs/design.md rule 8): torch's
FlashAttention-2 backward on our forward's out/lse vs our Triton backward vs float64 autograd.

On a GPU (``python -m pytest -q tests/triton_checks/check_attention_backward_flash.py``): GQA
16/8 and 32/8 heads at D = 128, packed sequences of uneven lengths including 1, bf16 (and fp16),
strided q/k/v, and which backward autograd picks per mode. Under TRITON_INTERPRET=1
VEXACT_BACKEND=triton (tests/test_triton_interpreter.py, CPU) the flash kernel cannot run: there
the checks are that every mode routes to the Triton backward or refuses, and its gradients.
"""

import sys
from pathlib import Path

import pytest
import torch

# pytest's importlib mode does not put this folder on sys.path; importing the shared helpers
# also applies their skip rule (conftest.py patches the interpreter's tl.dot)
sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, INTERPRET, close

from vexact_models.kernels import UnsupportedError, attention, attention_packed, packed_layout
from vexact_models.kernels.attention_backward import attention_backward_triton, attention_math
from vexact_models.kernels.attention_backward_choice import choose_attention_backward, use_attention_backward
from vexact_models.kernels.attention_backward_cudnn import cudnn_backward_available
from vexact_models.kernels.attention_backward_flash import (attention_backward_flash, flash_backward_available,
                                                            natural_lse)

BF16_TOL = 2e-2  # as check_attention.test_attention_backward


def _packed(lens, hq, hkv, d, dtype, dv=None):
    t = sum(lens)
    q, k = (torch.randn(t, h, d, device=DEVICE).to(dtype) for h in (hq, hkv))
    v = torch.randn(t, hkv, dv or d, device=DEVICE).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return q, k, v, cu


def _grads(q, k, v, cu, max_seqlen, scale, g, mode):
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with use_attention_backward(mode):
        return torch.autograd.grad(attention_packed(qg, kg, vg, cu, max_seqlen, scale), (qg, kg, vg), g)


def _float64(q, k, v, cu, scale, g):
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(attention_math(qd, kd, vd, cu, scale), (qd, kd, vd), g.double())


def test_forward_lse_converts_to_fa2_natural_lse():
    """What the flash backward is fed: our forward's LSE through `natural_lse` is ln(sum over the
    causal keys of exp(scale * q.k)) at [head, token], the layout FA2's varlen backward reads."""
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    lens, scale = [1, 7, 20], 0.125
    q, k, v, cu = _packed(lens, 4, 2, 64, dtype)
    _, lse = attention(q, k, v, packed_layout(cu, 20), scale, return_lse=True)
    got = natural_lse(lse)
    want = torch.empty_like(got, dtype=torch.float64)
    bounds = cu.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        qs = q[start:stop].double().transpose(0, 1)
        ks = k[start:stop].double().repeat_interleave(2, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale
        causal = torch.ones(stop - start, stop - start, dtype=torch.bool, device=DEVICE).tril()
        want[:, start:stop] = torch.logsumexp(scores.masked_fill(~causal, float("-inf")), -1)
    assert got.is_contiguous() and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)


def test_every_mode_routes_to_triton_or_refuses_where_flash_cannot_run():
    """Under the interpreter (CPU) and, on a GPU, for MLA's qk 192 / v 128: triton runs the Triton
    backward (bitwise the direct call), and so does auto unless cuDNN takes the shape; flash
    refuses naming the reason."""
    d, dv, dtype = (64, 64, torch.float32) if INTERPRET else (192, 128, torch.bfloat16)
    lens = [1, 7, 20]
    q, k, v, cu = _packed(lens, 4, 2, d, dtype, dv)
    assert not flash_backward_available(q, k, v)
    g = torch.randn(q.shape[0], 4, dv, device=DEVICE).to(dtype)
    out, lse = attention(q, k, v, packed_layout(cu, 20), 0.125, return_lse=True)
    direct = attention_backward_triton(g, q, k, v, out, lse, cu, 20, 0.125)
    auto_runs_triton = choose_attention_backward(q, k, v, cu, 20, 0.125) == "triton"
    for mode in ("auto", "triton") if auto_runs_triton else ("triton",):
        for a, b in zip(_grads(q, k, v, cu, 20, 0.125, g, mode), direct):
            assert torch.equal(a, b)
    for a, b in zip(direct, _float64(q, k, v, cu, 0.125, g)):
        close(a, b, 1e-5 if INTERPRET else BF16_TOL)
    with pytest.raises(UnsupportedError, match="'flash'"):
        _grads(q, k, v, cu, 20, 0.125, g, "flash")


if not INTERPRET:  # defined only on a GPU, so that the interpreter run reports no skips
    LENS = [1, 77, 300, 1000, 5, 640]

    @pytest.mark.parametrize("hq,hkv,dtype", [(16, 8, torch.bfloat16), (32, 8, torch.bfloat16), (32, 8, torch.float16)])
    def test_flash_backward_matches_triton_and_float64(hq, hkv, dtype):
        q, k, v, cu = _packed(LENS, hq, hkv, 128, dtype)
        scale, max_seqlen = 128 ** -0.5, max(LENS)
        g = torch.randn_like(q)
        out, lse = attention(q, k, v, packed_layout(cu, max_seqlen), scale, return_lse=True)
        flash = attention_backward_flash(g, q, k, v, out, lse, cu, max_seqlen, scale)
        triton_ = attention_backward_triton(g, q, k, v, out, lse, cu, max_seqlen, scale)
        want = _float64(q, k, v, cu, scale, g)
        for f, t, w, x in zip(flash, triton_, want, (q, k, v)):
            assert f.shape == x.shape and f.dtype == x.dtype and torch.isfinite(f).all()
            close(f, w, BF16_TOL)
            close(t, w, BF16_TOL)
            close(f, t, BF16_TOL)

    def test_autograd_picks_cudnn_then_flash_by_default():
        """auto runs cuDNN's backward where the cuDNN frontend is installed, else the flash one;
        under deterministic algorithms its gradients equal the forced kernel's bitwise, and
        triton is the direct Triton call bitwise. Strictly deterministic: with ``warn_only=True``
        torch only warns and FA2 keeps its atomic dQ (cuDNN's graph asks for its deterministic
        algorithm either way)."""
        q, k, v, cu = _packed([1, 129, 300], 16, 8, 128, torch.bfloat16)
        g = torch.randn_like(q)
        expected = "cudnn" if cudnn_backward_available(q, k, v) else "flash"
        assert choose_attention_backward(q, k, v, cu, 300, 0.1) == expected
        torch.use_deterministic_algorithms(True)
        try:
            auto, forced, triton_ = (_grads(q, k, v, cu, 300, 0.1, g, mode) for mode in ("auto", expected, "triton"))
        finally:
            torch.use_deterministic_algorithms(False)
        for a, b in zip(auto, forced):
            assert torch.equal(a, b)
        out, lse = attention(q, k, v, packed_layout(cu, 300), 0.1, return_lse=True)
        for a, b in zip(triton_, attention_backward_triton(g, q, k, v, out, lse, cu, 300, 0.1)):
            assert torch.equal(a, b)

    def test_flash_backward_strided_qkv():
        """q, k, v as head slices of one fused projection output (row stride > heads * D)."""
        lens, hq, hkv, d = [1, 250, 33], 16, 8, 128
        t = sum(lens)
        qkv = torch.randn(t, hq + 2 * hkv, d, device=DEVICE).bfloat16().requires_grad_()
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        assert q.stride(0) == (hq + 2 * hkv) * d and not q.is_contiguous()
        cu = torch.tensor([0, 1, 251, 284], dtype=torch.int32, device=DEVICE)
        g = torch.randn(t, hq, d, device=DEVICE).bfloat16()
        with use_attention_backward("flash"):
            (got,) = torch.autograd.grad(attention_packed(q, k, v, cu, 250, d ** -0.5), (qkv,), g)
        close(got, torch.cat(_float64(q, k, v, cu, d ** -0.5, g), dim=1), BF16_TOL)
