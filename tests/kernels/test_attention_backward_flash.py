"""The flash attention backward on CPU: when it applies, input checks, and that the CPU training
path keeps matching float64 autograd whatever the switch says. The kernel itself runs only on a
GPU: tests/triton_checks/check_attention_backward_flash.py."""

import pytest
import torch

from vexact_models.kernels import attention_packed
from vexact_models.kernels.attention_backward import attention_math
from vexact_models.kernels.attention_backward_choice import use_attention_backward
from vexact_models.kernels.attention_backward_flash import (attention_backward_flash, flash_attention_backward_op,
                                                            flash_backward_available, flash_backward_unavailable_reason,
                                                            natural_lse)

from ..conftest import rel_err


def _qkv(t=10, hq=4, hkv=2, d=16, dv=None, dtype=torch.bfloat16):
    return (torch.randn(t, hq, d).to(dtype), torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, dv or d).to(dtype))


pytestmark = pytest.mark.usefixtures("clean_attention_backward")


def test_op_is_in_this_torch_build():
    """The schema the module calls positionally (torch 2.11 and 2.13 agree)."""
    schema = str(torch.ops.aten._flash_attention_backward.default._schema)
    assert "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, " \
           "bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None" in schema


def test_op_call_binds_to_the_real_schema_on_meta_tensors():
    """The exact call the GPU makes, dispatched to torch's meta kernel for the op: argument
    count, positions, the keyword `scale` and the rng tensors' types bind; GQA shapes come back."""
    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dtype)

    q, k, v = meta(10, 4, 16), meta(10, 2, 16), meta(10, 2, 16)
    lse, cu = meta(4, 10, dtype=torch.float32), meta(3, dtype=torch.int32)
    dq, dk, dv = flash_attention_backward_op(meta(10, 4, 16), q, k, v, meta(10, 4, 16), lse, cu, 7, 0.25)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dq.dtype == torch.bfloat16


def test_natural_lse_is_the_transposed_natural_log_sum_exp():
    """FA2's varlen backward reads ln(sum exp(scale * s)) as a contiguous [Hq, T]; ours is the
    base-2 value, [T, Hq]."""
    scores = torch.randn(7, 3, 11, dtype=torch.float64) * 4  # [T, Hq, keys], already scaled
    lse_log2 = (torch.logsumexp(scores, -1) / torch.log(torch.tensor(2.0, dtype=torch.float64))).float()
    got = natural_lse(lse_log2)
    assert got.shape == (3, 7) and got.is_contiguous() and got.dtype == torch.float32
    assert torch.allclose(got.double(), torch.logsumexp(scores, -1).t(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case,expect", [
    (dict(), "CUDA"),  # GQA bf16 at an FA2 head dim: only the device is missing
    (dict(dtype=torch.float32), "dtype"),
    (dict(dtype=torch.float64), "dtype"),
    (dict(d=192, dv=128), "head dims"),  # MLA expanded: qk 192, v 128
    (dict(d=12), "multiple of 8"),
    (dict(d=320), "<= 256"),
])
def test_not_available_on_cpu_fp32_or_mismatched_head_dims(case, expect):
    q, k, v = _qkv(**case)
    reason = flash_backward_unavailable_reason(q, k, v)
    assert reason is not None and expect in reason, reason
    assert not flash_backward_available(q, k, v)


def test_not_available_for_latent_mla_or_mixed_dtypes():
    k = torch.randn(10, 1, 576).bfloat16()
    assert "head dims" in flash_backward_unavailable_reason(torch.randn(10, 4, 576).bfloat16(), k, k[..., :512])
    q, k, v = _qkv()
    assert "dtype" in flash_backward_unavailable_reason(q, k, v.half())


def test_attention_backward_flash_rejects_bad_input_before_launching():
    q, k, v = _qkv()
    out, g, lse, cu = torch.randn_like(q), torch.randn_like(q), torch.zeros(10, 4), torch.tensor([0, 3, 10])
    with pytest.raises(ValueError, match=r"lse_log2 is \(4, 10\).*\[10, 4\] float32"):
        attention_backward_flash(g, q, k, v, out, lse.t(), cu, 7, 0.25)
    with pytest.raises(ValueError, match="grad_out is"):
        attention_backward_flash(g.float(), q, k, v, out, lse, cu, 7, 0.25)
    with pytest.raises(ValueError, match="must be \\[tokens, heads, head_dim\\]"):
        attention_backward_flash(g, q[0], k, v, out, lse, cu, 7, 0.25)
    with pytest.raises(ValueError, match="attention_backward_flash: devices .* CUDA"):
        attention_backward_flash(g, q, k, v, out, lse, cu, 7, 0.25)


@pytest.mark.parametrize("mode", ["auto", "cudnn", "flash", "triton"])
def test_cpu_path_matches_float64_autograd_under_every_mode(mode):
    """The reference backend has one backward: the switch leaves CPU training unchanged."""
    lens = [1, 6, 13]
    cu = torch.tensor([0, 1, 7, 20], dtype=torch.int32)
    q, k, v = (x.float().requires_grad_() for x in _qkv(20, 4, 2, 16, dtype=torch.float32))
    g = torch.randn(20, 4, 16)
    with use_attention_backward(mode):
        got = torch.autograd.grad(attention_packed(q, k, v, cu, max(lens), 0.3), (q, k, v), g)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attention_math(qd, kd, vd, cu, 0.3), (qd, kd, vd), g.double())
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and rel_err(a, b) < 1e-5
