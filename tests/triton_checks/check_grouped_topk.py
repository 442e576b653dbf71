"""The grouped (DeepSeek-V3) router's Triton kernel vs its CPU reference; see check_triton_kernels."""

import sys
from pathlib import Path

import pytest
import torch

# pytest's importlib mode does not put this folder on sys.path; importing the shared helpers
# also applies their skip rule (conftest.py patches the interpreter's tl.dot)
sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, close, rand, ref

from vexact_models.kernels.grouped_topk import sigmoid_grouped_topk, sigmoid_grouped_topk_triton


def _separated_logits(tokens, experts):
    """Logits whose sigmoid scores are >= 1e-3 apart within each row, so rounding (tl.exp vs
    exact_math.exp) cannot flip a selection; the tests' bias (~0.05) keeps near-ties improbable."""
    keys = torch.rand(tokens, experts).argsort(1).float()  # a random permutation of 0..E-1 per row
    return (keys / experts * 6 - 3 + torch.rand(tokens, 1) * 0.5).to(DEVICE)


# (experts, top_k, n_group, topk_group): DeepSeek-V3, Moonlight, groups of 3 and of 1 (padded
# tiles), top_k not a power of two, all experts picked
CASES = [(256, 8, 8, 4), (64, 6, 1, 1), (24, 5, 8, 3), (12, 4, 12, 5), (16, 16, 4, 4)]


@pytest.mark.parametrize("experts,top_k,n_group,topk_group", CASES)
@pytest.mark.parametrize("norm,scale", [(True, 2.5), (False, 1.0)])
def test_grouped_topk(experts, top_k, n_group, topk_group, norm, scale):
    logits = _separated_logits(37, experts)
    bias = rand(experts) * 0.05
    args = (top_k, n_group, topk_group, norm, scale)
    w, ids = sigmoid_grouped_topk(logits, bias, *args)
    w_ref, ids_ref = ref(sigmoid_grouped_topk, logits, bias, *args)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (37, top_k)
    assert torch.equal(ids, ids_ref)
    close(w, w_ref, 1e-6)


@pytest.mark.parametrize("num_warps", [1, 2, 8])
def test_grouped_topk_warps_change_no_bit(num_warps):
    """The picks are max / min / a sum of one nonzero score, exact in any reduction order, so a
    launch of any warp count (what `benchmarks/moe_routing.py` sweeps) returns the default's bits.
    Plain random logits, near-ties included: every launch must still agree."""
    for experts, top_k, n_group, topk_group in ((256, 8, 8, 4), (64, 6, 1, 1)):
        logits, bias = rand(8, experts), rand(experts) * 0.05
        args = (logits, bias, top_k, n_group, topk_group, True, 2.5)
        for got, want in zip(sigmoid_grouped_topk_triton(*args, num_warps=num_warps), sigmoid_grouped_topk_triton(*args)):
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="num_warps=3 must be 1, 2, 4 or 8"):
        sigmoid_grouped_topk_triton(*args, num_warps=3)


def test_grouped_topk_takes_a_bf16_bias_as_its_fp32_value():
    """A model cast whole to bf16 holds a bf16 bias; the kernel widens it as it loads it (no cast
    launch per layer): bitwise the result of the bias cast to fp32 first."""
    logits = _separated_logits(37, 64)
    bias = (rand(64) * 0.05).bfloat16()
    got = sigmoid_grouped_topk(logits, bias, 6, 8, 4, True, 2.5)
    want = sigmoid_grouped_topk(logits, bias.float(), 6, 8, 4, True, 2.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_grouped_topk_ties_and_strided_input():
    logits = torch.zeros(3, 16, device=DEVICE)  # all equal: lowest groups, then lowest experts
    w, ids = sigmoid_grouped_topk(logits, torch.zeros(16, device=DEVICE), 5, 4, 2, False, 1.0)
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 3 and torch.equal(w, torch.full_like(w, 0.5))
    wide = _separated_logits(9, 64)
    bias = rand(32) * 0.05
    got = sigmoid_grouped_topk(wide[:, ::2], bias, 6, 4, 2, True, 2.0)
    want = ref(sigmoid_grouped_topk, wide[:, ::2].contiguous(), bias, 6, 4, 2, True, 2.0)
    assert torch.equal(got[1], want[1])
    close(got[0], want[0], 1e-6)


def test_grouped_topk_backward():
    logits = _separated_logits(11, 32).requires_grad_()
    bias, g = rand(32) * 0.05, rand(11, 8)
    w, ids = sigmoid_grouped_topk(logits, bias, 8, 8, 4, True, 2.5)
    (got,) = torch.autograd.grad(w, logits, g)
    x = logits.detach().cpu().double().requires_grad_()
    picked = torch.sigmoid(x).gather(1, ids.cpu())
    (want,) = torch.autograd.grad(2.5 * picked / picked.sum(1, keepdim=True), x, g.cpu().double())
    close(got.cpu(), want, 1e-5)


def test_grouped_topk_nan_row_stays_in_range():
    """CUDA-graph padding rows have NaN logits: ids must stay valid, like the reference's."""
    logits = _separated_logits(4, 64)
    logits[1] = float("nan")
    bias = rand(64) * 0.05
    w, ids = sigmoid_grouped_topk(logits, bias, 6, 8, 4, True, 2.5)
    w_ref, ids_ref = ref(sigmoid_grouped_topk, logits, bias, 6, 8, 4, True, 2.5)
    assert int(ids.min()) >= 0 and int(ids.max()) < 64
    assert torch.equal(ids, ids_ref)
    close(w, w_ref, 1e-6)
