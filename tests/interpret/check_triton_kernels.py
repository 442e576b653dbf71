"""Triton kernels vs the reference, run by Triton's CPU interpreter (TRITON_INTERPRET=1).

Checks kernel *logic* (indexing, masking, paging, GQA mapping, RNG bits) on tiny shapes. The
interpreter tiles through numpy/BLAS, so results are compared with tolerances here; bitwise
invariance is proven on the GPU by conformance/kernel_invariance.py.
Run through tests/test_triton_interpreter.py (it sets the environment).
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("VEXACT_BACKEND") != "triton":
    pytest.skip("run by tests/test_triton_interpreter.py", allow_module_level=True)

import numpy as np
import triton.language as tl
from triton.runtime import interpreter as _interpreter


def _patch_interpreter_bf16_dot():
    """triton 3.6's interpreter keeps bf16 as uint16 and matmuls the raw bit patterns in
    tl.dot; convert bf16 operands to fp32 first (the GPU compiler is not affected)."""
    builder = _interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(x):
            if x.dtype.scalar == tl.bfloat16:
                data = _interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return _interpreter.TensorHandle(data, tl.float32)
            return x
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


_patch_interpreter_bf16_dot()

from vexact_models.kernels import (PagedLayout, apply_rotary, attention, attention_packed, gather_logprobs,
                                   kv_cache_write, linear, log_softmax, rms_norm, rope_table, sample_tokens,
                                   silu_and_mul, use_backend)
from vexact_models.kernels.attention_backward import attention_math


def close(a, b, tol):
    a, b = a.double(), b.double()
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    assert err < tol, err


def ref(fn, *args, **kwargs):
    with use_backend("reference"):
        return fn(*args, **kwargs)


@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (65, 33, 129), (300, 20, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear(m, n, k, dtype):
    x, w, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    close(linear(x, w, b), ref(linear, x, w, b), 1e-2 if dtype == torch.bfloat16 else 1e-5)
    close(linear(x, w, out_dtype=torch.float32), ref(linear, x, w, out_dtype=torch.float32), 1e-5)


def test_rms_norm_rotary_silu():
    x, w = torch.randn(7, 3, 40), torch.rand(40)
    close(rms_norm(x, w, 1e-6), ref(rms_norm, x, w, 1e-6), 1e-5)
    cos, sin = rope_table(1.0 / (1e4 ** (torch.arange(0, 20) / 20)), 64)
    pos = torch.randint(0, 64, (7,))
    close(apply_rotary(x, pos, cos, sin), ref(apply_rotary, x, pos, cos, sin), 1e-6)
    g, u = torch.randn(5, 1000), torch.randn(5, 1000)
    close(silu_and_mul(g, u), ref(silu_and_mul, g, u), 1e-6)


def test_log_softmax_and_gather():
    x = torch.randn(4, 5000) * 3
    t = torch.randint(0, 5000, (4,))
    temps = torch.tensor([1.0, 0.5, 2.0, 0.9])
    full = log_softmax(x, temps)
    close(full, ref(log_softmax, x, temps), 1e-6)
    lp, lse = gather_logprobs(x, t, temps, return_lse=True)
    assert torch.equal(lp, full[torch.arange(4), t])
    close(lse, torch.logsumexp(x.double() / temps.double()[:, None], -1), 1e-6)


def test_kv_cache_write():
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 4)
    kc, vc = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 4)
    slots = torch.tensor([11, -1, 0, 4, 7])
    kv_cache_write(k, v, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    ref(kv_cache_write, k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (2, 2, 128), (8, 1, 64)])
def test_attention_packed_and_paged(hq, hkv, d):
    lens = [1, 20, 70]
    t = sum(lens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    cu = torch.tensor([0, 1, 21, 91], dtype=torch.int32)
    packed = attention_packed(q, k, v, cu, 70)
    close(packed, attention_math(q.double(), k.double(), v.double(), cu, d ** -0.5), 1e-5)
    # last 5 tokens of each sequence as a chunk over a paged cache (page 16, shuffled pages)
    page_size, pages = 16, [[3], [0, 5], [1, 6, 2, 7, 4]]
    table = torch.tensor([p + [0] * (5 - len(p)) for p in pages], dtype=torch.int32)
    kc, vc = torch.zeros(8, page_size, hkv, d), torch.zeros(8, page_size, hkv, d)
    slots = torch.tensor([table[s, p // page_size] * page_size + p % page_size
                          for s, n in enumerate(lens) for p in range(n)])
    kv_cache_write(k, v, kc, vc, slots)
    chunk = [min(5, n) for n in lens]
    idx = torch.cat([torch.arange(int(cu[s + 1]) - chunk[s], int(cu[s + 1])) for s in range(3)])
    layout = PagedLayout(torch.tensor([0, 1, 6, 11], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                         table, page_size, 5)
    close(attention(q[idx], kc, vc, layout), packed[idx], 1e-5)


def test_attention_backward():
    lens = [3, 40, 90]
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 64).bfloat16().requires_grad_() for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 43, 133], dtype=torch.int32)
    g = torch.randn(t, 4, 64).bfloat16()
    got = torch.autograd.grad(attention_packed(q, k, v, cu, 90), (q, k, v), g)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attention_math(qd, kd, vd, cu, 0.125), (qd, kd, vd), g.double())
    for a, b in zip(got, want):
        close(a, b, 2e-2)


def test_sampling_matches_reference():
    logits = torch.randn(16, 3000) * 2
    temps = torch.tensor([0.0, 0.5, 1.0, 1.5] * 4)
    seeds = torch.arange(16) * 1_000_003 + (1 << 40)
    steps = torch.arange(16) * 7
    thr = torch.where(torch.arange(16) % 3 == 0, torch.tensor(1.0), torch.tensor(float("-inf")))
    got = sample_tokens(logits, temps, seeds, steps, thr)
    want = ref(sample_tokens, logits, temps, seeds, steps, thr)
    assert torch.equal(got, want)
