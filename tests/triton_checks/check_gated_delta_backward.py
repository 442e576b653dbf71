"""The gated delta rule's Triton backward (`gated_delta_backward`) against autograd through the float64
CPU reference, its bits repeated run to run, and the switch routing `gated_delta_rule`'s backward: under
TRITON_INTERPRET=1 on CPU and on a GPU (docs/design.md rule 8, section 6b)."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = 2e-5 if INTERPRET else 2e-4  # the interpreter's dots are fp32, the GPU's tf32x3

from vexact_models.kernels import use_backend  # noqa: E402
from vexact_models.kernels.gated_delta_backward import training_backward, use_gated_delta_backward  # noqa: E402
from vexact_models.kernels.gated_delta_rule import gated_delta_rule  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _inputs(lengths, hk, hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lengths), len(lengths)
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.6 - 0.01
    beta = torch.rand(t, hv, generator=gen) * 0.9 + 0.05
    state = torch.randn(b, hv, dk, dv, generator=gen) * 0.2
    d_out = torch.randn(t, hv, dv, generator=gen)
    d_final = torch.randn(b, hv, dk, dv, generator=gen)
    return [q, k, v, g, beta, state], d_out, d_final


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _grads(tensors, d_out, d_final, lengths, chunk, *, initial, final, l2norm=True, backend="triton"):
    """The gradients of `gated_delta_rule`'s inputs (None for an absent initial state)."""
    leaves = [x.clone().requires_grad_() for x in tensors]
    with use_backend(backend):
        out, last = gated_delta_rule(*leaves[:5], _cu(lengths), initial_state=leaves[5] if initial else None,
                                     output_final_state=final, use_qk_l2norm=l2norm, chunk_size=chunk)
    outputs, grads = [out], [d_out.to(out.dtype)]
    if final:
        outputs.append(last), grads.append(d_final)
    wanted = leaves if initial else leaves[:5]
    return list(torch.autograd.grad(outputs, wanted, grads)) + ([] if initial else [None])


def _reference(tensors, d_out, d_final, lengths, chunk, **kwargs):
    """Autograd through the CPU reference in float64."""
    return _grads([x.cpu().double() for x in tensors], d_out.cpu().double(), d_final.cpu().double(), lengths, chunk,
                  backend="reference", **kwargs)


@pytest.mark.parametrize("hk,hv,dk,dv,chunk,lengths,initial,final,l2norm", [
    (2, 2, 16, 16, 16, [37, 16, 21], True, True, True),
    (1, 2, 16, 32, 16, [40, 1, 0, 17], False, True, True),
    (1, 2, 32, 16, 32, [70, 9], True, False, True),
    (1, 1, 16, 128, 16, [20], True, True, False),
    (1, 2, 16, 16, 64, [70, 30], False, False, True),
    (1, 2, 64, 16, 16, [30, 5], True, True, True),  # the pair kernels' four key parts
])
def test_triton_backward_matches_autograd(hk, hv, dk, dv, chunk, lengths, initial, final, l2norm):
    """Grouped heads, an empty and a one-token sequence, chunks cut mid-sequence and whole, two
    value blocks (dv 128), with and without the initial state, the final state's gradient, the l2 norm."""
    tensors, d_out, d_final = _inputs(lengths, hk, hv, dk, dv)
    if not l2norm:
        tensors[0], tensors[1] = tensors[0] * 0.25, tensors[1] * 0.25
    tensors, d_out, d_final = [x.to(DEVICE) for x in tensors], d_out.to(DEVICE), d_final.to(DEVICE)
    kwargs = dict(initial=initial, final=final, l2norm=l2norm)
    with use_gated_delta_backward("triton"):
        got = _grads(tensors, d_out, d_final, lengths, chunk, **kwargs)
    want = _reference(tensors, d_out, d_final, lengths, chunk, **kwargs)
    for name, a, b in zip(NAMES, got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == torch.float32, name
        assert (a.cpu().double() - b).abs().max() <= TOL * b.abs().max(), name


def test_triton_backward_repeats_bitwise_and_keeps_dtypes():
    lengths = [20, 9]
    tensors, d_out, d_final = _inputs(lengths, 1, 2, 16, 32, seed=1)
    tensors = [x.to(DEVICE) for x in tensors]
    tensors = [x.bfloat16() if i in (0, 1, 2, 4) else x for i, x in enumerate(tensors)]
    runs = [_grads(tensors, d_out.to(DEVICE), d_final.to(DEVICE), lengths, 16, initial=True, final=True)
            for _ in range(2)]
    assert [x.dtype for x in runs[0]] == [torch.bfloat16] * 3 + [torch.float32, torch.bfloat16, torch.float32]
    for name, a, b in zip(NAMES, *runs):
        assert torch.equal(a, b), name


def test_switch_routes_the_backward():
    """``triton``: `training_backward`'s kernels, bit for bit; ``autograd``: torch autograd through
    the recomputed forward, which differs from the kernels in the last bits."""
    lengths = [20, 5]
    tensors, d_out, _ = _inputs(lengths, 1, 2, 16, 16, seed=2)
    tensors, d_out = [x.to(DEVICE) for x in tensors], d_out.to(DEVICE)
    with use_gated_delta_backward("triton"):
        kernels = _grads(tensors, d_out, None, lengths, 16, initial=True, final=False)
    with use_gated_delta_backward("autograd"):
        autograd = _grads(tensors, d_out, None, lengths, 16, initial=True, final=False)
    direct = training_backward(*tensors, d_out, None, lengths, 16, 16 ** -0.5, True, "triton")
    assert all(torch.equal(a, b) for a, b in zip(kernels, direct))
    assert not all(torch.equal(a, b) for a, b in zip(kernels, autograd))
    for name, a, b in zip(NAMES, kernels, autograd):
        assert (a - b).abs().max() <= TOL * b.abs().max(), name
