"""The gated delta rule's chunked backward: its torch reference against autograd and finite differences
(float64), the switch, the Triton kernels' sm_90 build on the CPU, and (marked gpu) the Triton backward
at Qwen3.5's heads against the float64 reference, repeated bitwise (docs/design.md rule 8, section 6b)."""

from pathlib import Path

import pytest
import torch

from vexact_models.kernels import gated_delta_backward_reference as bref
from vexact_models.kernels import gated_delta_reference as ref
from vexact_models.kernels.gated_delta_backward import (backward_mode, dot_precision, training_backward,
                                                         use_gated_delta_backward)
from vexact_models.kernels.gated_delta_rule import gated_delta_rule, training_forward

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(lengths, hk, hv, dk, dv, *, seed=0, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lengths), len(lengths)
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.6 - 0.01
    beta = torch.rand(t, hv, generator=gen) * 0.9 + 0.05
    state = torch.randn(b, hv, dk, dv, generator=gen) * 0.2
    d_out = torch.randn(t, hv, dv, generator=gen)
    d_final = torch.randn(b, hv, dk, dv, generator=gen)
    wide = torch.float64 if dtype == torch.float64 else torch.float32  # g and the states
    tensors = [x.to(dtype) for x in (q, k, v)] + [g.to(wide), beta.to(dtype), state.to(wide)]
    return [x.to(device) for x in tensors], d_out.to(device, wide), d_final.to(device, wide)


def cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def autograd_grads(tensors, d_out, d_final, lengths, chunk, *, l2norm=True, scale=None):
    """Autograd through `gated_delta_rule`'s CPU path (the recomputed forward)."""
    leaves = [x.clone().requires_grad_() for x in tensors]
    out, final = gated_delta_rule(*leaves[:5], cu(lengths), initial_state=leaves[5], output_final_state=True,
                                  use_qk_l2norm=l2norm, scale=scale, chunk_size=chunk)
    return torch.autograd.grad((out, final), leaves, (d_out.to(out.dtype), d_final.to(final.dtype)))


@pytest.mark.parametrize("hk,hv,dk,dv,chunk,lengths,l2norm", [
    (2, 2, 16, 8, 16, [37, 16, 21], True),
    (1, 4, 8, 16, 16, [40, 0, 1, 17], True),
    (1, 2, 16, 16, 32, [70, 9], False),
])
def test_reference_backward_matches_autograd(hk, hv, dk, dv, chunk, lengths, l2norm):
    tensors, d_out, d_final = make_inputs(lengths, hk, hv, dk, dv)
    got = training_backward(*tensors, d_out, d_final, lengths, chunk, 0.3, l2norm, "reference")
    want = autograd_grads(tensors, d_out, d_final, lengths, chunk, l2norm=l2norm, scale=0.3)
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype == torch.float64, name
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), name


def test_reference_backward_matches_finite_differences():
    """``<grad, d>`` against the central difference of ``<o, dO> + <final, dS>`` (the batch-invariant
    forward, `training_forward`) along a random direction ``d`` of each input."""
    lengths, chunk = [21, 12], 16
    tensors, d_out, d_final = make_inputs(lengths, 1, 2, 8, 8, seed=3)
    grads = training_backward(*tensors, d_out, d_final, lengths, chunk, 0.35, True, "reference")

    def loss(xs):
        out, final = training_forward(*xs, lengths, 0.35, True, True, "reference")
        return (out * d_out).sum() + (final * d_final).sum()

    gen = torch.Generator().manual_seed(4)
    eps = 1e-6
    for i, (name, grad) in enumerate(zip(NAMES, grads)):
        direction = torch.randn(tensors[i].shape, generator=gen, dtype=torch.float64)
        plus = [x + eps * direction if j == i else x for j, x in enumerate(tensors)]
        minus = [x - eps * direction if j == i else x for j, x in enumerate(tensors)]
        numeric = (loss(plus) - loss(minus)) / (2 * eps)
        assert abs(float((grad * direction).sum() - numeric)) <= 1e-6 * max(1.0, abs(float(numeric))), name


def test_chunk_grads_and_state_grad_step_match_autograd_of_a_chunk():
    """One chunk with absent trailing rows (exact zeros): `chunk_grads` and `state_grad_step` against
    autograd through `gated_delta_reference.chunk_forward`."""
    gen = torch.Generator().manual_seed(6)
    n, c, dk, dv = 3, 32, 16, 8

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v, s, d_out, d_end = rand(n, c, dk), rand(n, c, dk), rand(n, c, dv), rand(n, dk, dv), rand(n, c, dv), \
        rand(n, dk, dv)
    g = -torch.rand(n, c, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(n, c, generator=gen, dtype=torch.float64)
    for x in (q, k, v, g, beta):
        x[-1, 20:] = 0.0
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, s)]
    out, new = ref.chunk_forward(*leaves[:5], leaves[5], ref.AUTOGRAD, scale=0.3, use_qk_l2norm=True)
    want = torch.autograd.grad((out, new), leaves, (d_out, d_end))
    got = bref.chunk_grads(q, k, v, g, beta, s, d_out, d_end, scale=0.3, use_qk_l2norm=True)
    keys = bref.chunk_keys(q, k, g, beta, scale=0.3, use_qk_l2norm=True)
    got = [*got, bref.state_grad_step(keys, d_out, d_end)]
    for name, a, b in zip(NAMES, got, want):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), name


def test_l2norm_backward_and_reverse_prefix_sum():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    want, = torch.autograd.grad(ref.l2norm(x, ref.AUTOGRAD), x, dy)
    assert torch.allclose(bref.l2norm_backward(x.detach(), dy), want, rtol=0, atol=1e-14)
    want, = torch.autograd.grad(x.cumsum(-1), x, dy)
    assert torch.allclose(bref.reverse_prefix_sum(dy), want, rtol=0, atol=1e-14)


def test_switch_modes_and_the_cpu_path(monkeypatch):
    """`use_gated_delta_backward` wins over the environment and restores it; a bad value names the
    variable; on the reference backend (CPU) the backward is autograd whatever the switch says."""
    monkeypatch.delenv("VEXACT_GATED_DELTA_BACKWARD", raising=False)
    assert backward_mode() == "triton"
    monkeypatch.setenv("VEXACT_GATED_DELTA_BACKWARD", "autograd")
    assert backward_mode() == "autograd"
    with use_gated_delta_backward("triton"):
        assert backward_mode() == "triton"
    assert backward_mode() == "autograd"
    monkeypatch.setenv("VEXACT_GATED_DELTA_BACKWARD", "fast")
    with pytest.raises(ValueError, match="VEXACT_GATED_DELTA_BACKWARD='fast' is not a gated delta rule backward"):
        backward_mode()
    monkeypatch.delenv("VEXACT_GATED_DELTA_BACKWARD")
    tensors, d_out, d_final = make_inputs([20], 1, 1, 8, 8, dtype=torch.float32)
    runs = []
    for mode in ("triton", "autograd"):
        with use_gated_delta_backward(mode):
            runs.append(autograd_grads(tensors, d_out, d_final, [20], 16))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_triton_backward_kernels_compile_for_hopper_on_cpu(monkeypatch):
    """The fold and the backward's launches compile for sm_90 without a GPU at a tiny shape and
    chunk 64, their products on the tensor cores and none split into 8-column TF32 wgmma
    (`gated_delta_triton.SMALL_HEAD_WARPS`), each within Hopper's 227 KiB of shared memory (at
    Qwen3.5's heads: docs/design.md section 6b)."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sm90_compile import compile_only, resources

    wgmma = {}
    for dtype in (torch.bfloat16, torch.float32):
        tensors, d_out, _ = make_inputs([70], 1, 1, 16, 16, dtype=dtype)
        with compile_only() as compiled:
            training_backward(*tensors[:5], None, d_out.to(dtype), None, [70], 64, 0.25, True, "triton")
        assert [kernel.name for kernel in compiled] == ["fold_prep_kernel", "fold_kernel", "query_prep_kernel",
                                                        "state_grad_kernel", "value_grad_kernel", "key_sums_kernel",
                                                        "pair_grad_kernel", "key_beta_grad_kernel", "key_grad_kernel"]
        for kernel in compiled[1:]:
            assert resources(kernel).wgmma > 0, kernel.name
            assert "m64n8k8" not in kernel.asm["ptx"], kernel.name
            assert kernel.metadata.shared <= 227 * 1024, kernel.name
        wgmma[dtype] = [resources(kernel).wgmma for kernel in compiled[2:]]
    # bf16 inputs: one TF32 product a dot (`dot_precision`); fp32: tf32x3's three
    assert [3 * n for n in wgmma[torch.bfloat16]] == wgmma[torch.float32]


def test_dot_precision_follows_the_inputs_widths():
    bf16, fp16, fp32 = (torch.zeros(2, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert dot_precision(bf16, fp16, bf16) == "tf32"
    assert dot_precision(bf16, fp32, bf16) == dot_precision(fp32) == "tf32x3"


# --- the Triton backward on the GPU, at the published head shapes ---------------------------------------

QWEN35_HEADS = (16, 32, 128, 128)  # Qwen3.5-35B-A3B, Qwen3.5's default text config, Qwen3-Next-80B-A3B


def gpu_grads(tensors, d_out, d_final, lengths):
    leaves = [x.clone().requires_grad_() for x in tensors]
    with use_gated_delta_backward("triton"):
        out, final = gated_delta_rule(*leaves[:5], cu(lengths), initial_state=leaves[5], output_final_state=True)
        return torch.autograd.grad((out, final), leaves, (d_out.to(out.dtype), d_final))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_backward_matches_float64_reference(dtype):
    """Qwen3.5's heads, sequences of several chunks, one cut mid-chunk, one of one token: the
    Triton backward against autograd through the CPU reference in float64 on the same values."""
    lengths = [300, 64, 129, 1]
    tensors, d_out, d_final = make_inputs(lengths, *QWEN35_HEADS, dtype=dtype, device="cuda")
    got = gpu_grads(tensors, d_out, d_final, lengths)
    want = autograd_grads([x.cpu().double() for x in tensors], d_out.cpu().double(), d_final.cpu().double(), lengths,
                          64)
    tol = 2e-4 if dtype == torch.float32 else 1e-2  # tf32x3 dots; bf16: TF32 dots, gradients rounded to bf16
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == tensors[NAMES.index(name)].dtype, name
        assert (a.cpu().double() - b).abs().max() <= tol * b.abs().max(), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_backward_repeats_bitwise():
    lengths = [1000, 77, 500]
    tensors, d_out, d_final = make_inputs(lengths, *QWEN35_HEADS, dtype=torch.bfloat16, device="cuda", seed=1)
    first, second = (gpu_grads(tensors, d_out, d_final, lengths) for _ in range(2))
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name
