"""attention_packed's forward as a dispatcher op: its (out, lse), activation checkpointing that
keeps them, and one registration of the op however often the folder is imported."""

import importlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint, noop_context_fn

from vexact_models.kernels import attention, attention_packed, checkpoint_saving_context, packed_layout

from .test_attention import _packed

ROOT = Path(__file__).resolve().parents[2]


def _lse_float64(q, k, cu, scale):
    """log2 of sum over each row's visible keys of exp2(q.k * scale * log2(e)), the kernel's LSE."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[:2], dtype=torch.float64)
    for s in range(len(cu) - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double().repeat_interleave(group, 1)) * scale
        scores = scores.masked_fill(torch.ones(b - a, b - a).triu(1).bool(), float("-inf"))
        out[a:b] = (torch.logsumexp(scores, -1) * math.log2(math.e)).T
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_op_returns_the_attention_output_and_its_lse(dtype):
    q, k, v, cu = _packed([5, 17, 1], dtype=dtype)
    out, lse = torch.ops.vexact.attention_packed_forward(q, k, v, cu, 17, 0.3)
    want_out, want_lse = attention(q, k, v, packed_layout(cu, 17), 0.3, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    torch.testing.assert_close(lse.double(), _lse_float64(q, k, cu, 0.3), rtol=1e-5, atol=1e-5)
    assert torch.equal(out, attention_packed(q, k, v, cu, 17, 0.3))


def _layer(q, k, v, cu):
    """A checkpointed region around attention: something recomputable on each side."""
    return (attention_packed(q * 1.5, k.sin(), v, cu, 17, 0.25) * 2).sum(-1).pow(2).sum()


@pytest.mark.parametrize("context_fn, runs", [(checkpoint_saving_context, 1), (noop_context_fn, 2)],
                         ids=["saving", "full recompute"])
def test_saving_context_runs_the_forward_once(monkeypatch, context_fn, runs):
    """Under `checkpoint_saving_context` the op runs once per forward+backward, and under full
    recompute twice; the gradients are bitwise those without checkpointing either way."""
    packed = importlib.import_module("vexact_models.kernels.attention_packed")  # the package's name is the op
    calls = []
    reference = packed.attention_reference
    monkeypatch.setattr(packed, "attention_reference", lambda *a, **kw: calls.append(1) or reference(*a, **kw))
    q, k, v, cu = (t.requires_grad_() if t.is_floating_point() else t for t in _packed([9, 17], dtype=torch.float64))
    want = torch.autograd.grad(_layer(q, k, v, cu), (q, k, v))
    calls.clear()
    got = torch.autograd.grad(checkpoint(_layer, q, k, v, cu, use_reentrant=False, context_fn=context_fn), (q, k, v))
    assert len(calls) == runs
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_importing_the_folder_again_leaves_the_op_with_the_package():
    """transformers' probe for a top-level ``kernels`` package can import kernels/ a second time
    (repository root on sys.path); the ops (attention's and the gated delta rule's, which
    checkpointing keeps) stay the package's, with the package's backend state."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import torch, vexact_models.kernels as pkg; "
            "import kernels; assert kernels is not pkg; "
            "from torch._library.custom_ops import OPDEFS; "
            "print(*(OPDEFS[f'vexact::{op}']._init_fn.__module__ for op in "
            "('attention_packed_forward', 'gated_delta_forward')))")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["vexact_models.kernels.attention_packed", "vexact_models.kernels.gated_delta_rule"]
