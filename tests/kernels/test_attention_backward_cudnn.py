"""The cuDNN attention backward on CPU: when it applies, its graph shape classes and input checks.
The kernel runs on a GPU: tests/triton_checks/check_attention_backward_cudnn.py."""

import pytest
import torch

from vexact_models.kernels import attention_backward_cudnn as cudnn_module
from vexact_models.kernels.attention_backward_cudnn import (attention_backward_cudnn, cudnn_backward_available,
                                                            cudnn_backward_unavailable_reason, graph_dims)


def _qkv(t=10, hq=4, hkv=2, d=16, dv=None, dtype=torch.bfloat16):
    return (torch.randn(t, hq, d).to(dtype), torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, dv or d).to(dtype))


def test_graph_dims_round_batches_into_shared_shape_classes():
    assert graph_dims(3, 1000, 2100) == (4, 1024, 2560)  # 2100 -> a multiple of 4096 / 8 = 512
    assert graph_dims(1, 10, 10) == (1, 64, 64)
    assert graph_dims(16, 1024, 16384) == (16, 1024, 16384)  # already on the grid
    assert graph_dims(5, 7000, 32769) == (8, 8192, 40960)  # an eighth of 65536
    for n, s, t in ((3, 100, 250), (9, 3000, 20000), (1, 32768, 32768)):
        b, s_max, tokens = graph_dims(n, s, t)
        assert b >= n and s_max >= s and t <= tokens <= 1.125 * t + 64 and tokens % 64 == 0


def test_equal_lengths_get_a_dense_graph_and_others_a_shape_class():
    """tokens == sequences * max_seqlen means every sequence has max_seqlen tokens: an exact dense
    graph; anything else the ragged shape class."""
    q, k, v = _qkv(t=12)
    assert cudnn_module._graph_key(q, k, v, 3, 4, 0.1)[2:6] == (True, 3, 4, 12)
    assert cudnn_module._graph_key(q, k, v, 1, 12, 0.1)[2:6] == (True, 1, 12, 12)
    assert cudnn_module._graph_key(q, k, v, 3, 5, 0.1)[2:6] == (False, *graph_dims(3, 5, 12))


def test_not_installed_is_named(monkeypatch):
    monkeypatch.setattr(cudnn_module, "_cudnn", lambda: None)
    reason = cudnn_backward_unavailable_reason(*_qkv())
    assert "not installed" in reason and "vexact-models[cudnn]" in reason


@pytest.mark.parametrize("case,expect", [
    (dict(), "CUDA"),  # GQA bf16 at a supported head dim: only the device is missing
    (dict(dtype=torch.float32), "dtype"),
    (dict(d=12), "multiple of 8"),
    (dict(d=320), "<= 256"),
    (dict(d=128, dv=12), "v head dim 12"),
])
def test_static_requirements(monkeypatch, case, expect):
    monkeypatch.setattr(cudnn_module, "_cudnn", lambda: object())  # as if the package were installed
    q, k, v = _qkv(**case)
    reason = cudnn_backward_unavailable_reason(q, k, v)
    assert reason is not None and expect in reason, reason
    assert not cudnn_backward_available(q, k, v)


def test_q_and_k_share_a_head_dim(monkeypatch):
    monkeypatch.setattr(cudnn_module, "_cudnn", lambda: object())
    q, k, v = _qkv()
    assert "head dims q=8, k=16" in cudnn_backward_unavailable_reason(q[..., :8], k, v)


def test_mla_head_dims_pass_the_static_checks(monkeypatch):
    """qk 192 / v 128 (MLA expanded) is left for cuDNN's own support check on the GPU."""
    monkeypatch.setattr(cudnn_module, "_cudnn", lambda: object())
    q, k, v = (t.cuda() if torch.cuda.is_available() else t for t in _qkv(d=192, dv=128))
    assert cudnn_module._static_reason(q, k, v) in (None, f"devices q={q.device}, k={k.device}, v={v.device}: "
                                                          "the cuDNN backward needs CUDA tensors on one GPU")


def test_rejects_bad_input_before_launching():
    q, k, v = _qkv()
    out, g, lse, cu = torch.randn_like(q), torch.randn_like(q), torch.zeros(10, 4), torch.tensor([0, 3, 10])
    with pytest.raises(ValueError, match=r"lse_log2 is \(4, 10\).*\[10, 4\] float32"):
        attention_backward_cudnn(g, q, k, v, out, lse.t(), cu, 7, 0.25)
    with pytest.raises(ValueError, match="grad_out is"):
        attention_backward_cudnn(g.float(), q, k, v, out, lse, cu, 7, 0.25)
    with pytest.raises(ValueError, match="do not pack"):
        attention_backward_cudnn(g, q, k[:5], v, out, lse, cu, 7, 0.25)
    with pytest.raises(ValueError, match="max_seqlen >= 1"):
        attention_backward_cudnn(g, q, k, v, out, lse, cu, 0, 0.25)
    with pytest.raises(ValueError, match="attention_backward_cudnn: (the cuDNN frontend|devices)"):
        attention_backward_cudnn(g, q, k, v, out, lse, cu, 7, 0.25)
