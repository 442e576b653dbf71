import random

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

from vexact_models.conformance.hybrid_invariance import conv_by_steps, packed_cu, random_steps
from vexact_models.kernels import causal_conv1d, conv_state_update
from vexact_models.kernels.causal_conv1d import conv_state_update_reference

from ..conftest import rel_err

LENS = [7, 1, 12, 3]


def _hf(x, weight, bias, lens, activation="silu"):
    """transformers' torch path (`causal_conv1d_fn`: F.conv1d with K - 1 zeros of left padding,
    then SiLU), one sequence at a time."""
    outs, start = [], 0
    for n in lens:
        seq = x[start:start + n].T[None]  # [1, C, L]
        outs.append(causal_conv1d_fn(seq, weight, bias, activation=activation)[0].T)
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_matches_transformers(dtype, with_bias, activation):
    x = torch.randn(sum(LENS), 24).to(dtype)
    w = (torch.randn(24, 4) / 2).to(dtype)
    b = torch.randn(24).to(dtype) if with_bias else None
    out = causal_conv1d(x, w, b, packed_cu(LENS, "cpu"), max(LENS), activation)
    assert out.shape == x.shape and out.dtype == dtype
    want = _hf(x.double(), w.double(), None if b is None else b.double(), LENS, activation)
    assert rel_err(out, want) < {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    if dtype == torch.bfloat16:  # at HF's rounding points: within one bf16 step of HF's own bf16 result
        hf = _hf(x, w, b, LENS, activation)
        assert (out.double() - hf.double()).abs().max() <= 2 ** -7 * hf.double().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rollout_pieces_equal_training_bitwise(dtype, seed):
    """Sequences cut anywhere (prompt pieces, single decode tokens), in steps of varied batches,
    with conv states in shuffled slots and padding: every output equals the training forward's."""
    lens = [13, 1, 6, 9, 2]
    x = torch.randn(sum(lens), 40).to(dtype)
    w, b = torch.randn(40, 4).to(dtype), torch.randn(40).to(dtype)
    for bias in (None, b):
        train = causal_conv1d(x, w, bias, packed_cu(lens, "cpu"), max(lens))
        steps = random_steps(lens, random.Random(seed))
        assert torch.equal(conv_by_steps(x, w, bias, lens, steps), train)
        # each sequence alone
        start = 0
        for n in lens:
            alone = causal_conv1d(x[start:start + n], w, bias, packed_cu([n], "cpu"), n)
            assert torch.equal(alone, train[start:start + n])
            start += n


def test_kernel_size_two_and_three():
    for k in (2, 3):
        x, w = torch.randn(9, 8, dtype=torch.float64), torch.randn(8, k, dtype=torch.float64)
        got = causal_conv1d(x, w, None, packed_cu([4, 5], "cpu"), 5)
        assert rel_err(got, _hf(x, w, None, [4, 5])) < 1e-14
        assert torch.equal(conv_by_steps(x, w, None, [4, 5], random_steps([4, 5], random.Random(k))), got)


def test_conv_state_update_keeps_the_last_inputs():
    x = torch.randn(6, 5)
    state = torch.full((4, 3, 5), 7.0)
    cu = packed_cu([1, 5, 0], "cpu")
    ctx = torch.tensor([1, 0, 4], dtype=torch.int32)
    conv_state_update(x, cu, state, torch.tensor([2, 0, 3], dtype=torch.int32), ctx)
    # slot 2: context 1, one token: positions -1 (a zero), 0 (the old state's last entry), 1 (x[0])
    assert torch.equal(state[2], torch.stack([torch.zeros(5), torch.full((5,), 7.0), x[0]]))
    assert torch.equal(state[0], x[3:6])  # five new tokens: the last three
    assert torch.equal(state[3], torch.full((3, 5), 7.0))  # no tokens: unchanged
    assert torch.equal(state[1], torch.full((3, 5), 7.0))  # no sequence there
    before = state.clone()
    conv_state_update(x[:1], packed_cu([1], "cpu"), state, torch.tensor([-1], dtype=torch.int32),
                      torch.tensor([3], dtype=torch.int32))
    assert torch.equal(state, before)  # padding sequence: skipped
    conv_state_update_reference(x[:2], packed_cu([2], "cpu"), state, torch.tensor([1], dtype=torch.int32),
                                torch.tensor([0], dtype=torch.int32))
    assert torch.equal(state[1], torch.stack([torch.zeros(5), x[0], x[1]]))


def test_causal_conv1d_backward_matches_autograd():
    lens = [5, 1, 8]
    x = torch.randn(14, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(14, 6, dtype=torch.float64)
    for activation in ("silu", None):
        got = torch.autograd.grad(causal_conv1d(x, w, b, packed_cu(lens, "cpu"), 8, activation), (x, w, b), g)
        want = torch.autograd.grad(_hf(x, w, b, lens, activation), (x, w, b), g)
        for a, e in zip(got, want):
            assert torch.allclose(a, e, rtol=1e-10, atol=1e-12)
    (gx,) = torch.autograd.grad(causal_conv1d(x, w.detach(), None, packed_cu(lens, "cpu"), 8), (x,), g)
    (want_x,) = torch.autograd.grad(_hf(x, w.detach(), None, lens), (x,), g)
    assert torch.allclose(gx, want_x, rtol=1e-10, atol=1e-12)


def test_causal_conv1d_errors():
    x, w, cu = torch.randn(4, 8), torch.randn(8, 4), packed_cu([4], "cpu")
    with pytest.raises(ValueError, match=r"weight must be contiguous \[8, kernel size 2..8\]"):
        causal_conv1d(x, torch.randn(8, 1, 4), None, cu, 4)
    with pytest.raises(ValueError, match="activation='gelu' is not one of"):
        causal_conv1d(x, w, None, cu, 4, "gelu")
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        causal_conv1d(x, w, None, cu.long(), 4)
    with pytest.raises(ValueError, match=r"bias .* must have x's dtype"):
        causal_conv1d(x, w, torch.randn(8).double(), cu, 4)
    with pytest.raises(ValueError, match=r"conv_state must be \[slots, 3, 8\]"):
        causal_conv1d(x, w, None, cu, 4, conv_state=torch.zeros(2, 4, 8), state_indices=cu[:1],
                      context_lens=cu[:1])
    with pytest.raises(ValueError, match=r"context_lens must be int32 \[1\]"):
        causal_conv1d(x, w, None, cu, 4, conv_state=torch.zeros(2, 3, 8), state_indices=cu[:1])
    with pytest.raises(ValueError, match=r"x must be \[tokens, channels\]"):
        causal_conv1d(x.T, w, None, cu, 4)
