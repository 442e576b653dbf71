"""The cuDNN attention backward (`kernels/attention_backward_cudnn.py`, docs/design.md rule 8): cuDNN's fused
SDPA backward on our forward's out/lse vs our Triton backward vs float64 autograd.

On a GPU with the cuDNN frontend installed (``pip install 'vexact-models[cudnn]'``; ``python -m
pytest -q tests/triton_checks/check_attention_backward_cudnn.py``): GQA 16/8 and 32/8 heads at
D = 128, packed sequences of uneven lengths including 1, bf16 and fp16, q/k contiguous and v a
view of a fused projection (as the models pass them), many sequences (the rounded-up batch),
equal-length batches (the dense graph),
shape classes sharing one graph, run-to-run repeatability under deterministic algorithms, and
MLA's qk 192 / v 128 (cuDNN's gradients if it takes the shape, else auto's Triton fallback).
Under TRITON_INTERPRET=1 VEXACT_BACKEND=triton (CPU) cuDNN cannot run: there the check is that
auto routes to the Triton backward and a forced cudnn refuses.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from check_attention_backward_flash import _float64, _grads
from check_triton_kernels import DEVICE, INTERPRET, close

from vexact_models.kernels import UnsupportedError, attention, packed_layout
from vexact_models.kernels import attention_backward_cudnn as cudnn_module
from vexact_models.kernels.attention_backward import attention_backward_triton
from vexact_models.kernels.attention_backward_choice import choose_attention_backward
from vexact_models.kernels.attention_backward_cudnn import attention_backward_cudnn, cudnn_backward_unavailable_reason

BF16_TOL = 2e-2  # as check_attention.test_attention_backward


def _packed(lens, hq, hkv, d, dtype, dv=None, fused_v=False):
    t = sum(lens)
    q, k = (torch.randn(t, h, d, device=DEVICE).to(dtype) for h in (hq, hkv))
    if fused_v:  # v as the models pass it: a head slice of the fused qkv projection's output
        v = torch.randn(t, hq + 2 * hkv, dv or d, device=DEVICE).to(dtype)[:, hq + hkv:]
    else:
        v = torch.randn(t, hkv, dv or d, device=DEVICE).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return q, k, v, cu


def test_auto_runs_triton_and_forced_cudnn_refuses_where_cudnn_cannot_run():
    """fp32 (the interpreter's dtype; on a GPU too): cuDNN's SDPA takes fp16/bf16 only."""
    lens = [1, 7, 20]
    q, k, v, cu = _packed(lens, 4, 2, 64, torch.float32)
    assert "dtype" in cudnn_backward_unavailable_reason(q, k, v) or cudnn_module._cudnn() is None
    assert choose_attention_backward(q, k, v, cu, 20, 0.125) == "triton"
    g = torch.randn_like(q)
    out, lse = attention(q, k, v, packed_layout(cu, 20), 0.125, return_lse=True)
    for a, b in zip(_grads(q, k, v, cu, 20, 0.125, g, "auto"), attention_backward_triton(g, q, k, v, out, lse, cu, 20,
                                                                                        0.125)):
        assert torch.equal(a, b)
    with pytest.raises(UnsupportedError, match="'cudnn'"):
        _grads(q, k, v, cu, 20, 0.125, g, "cudnn")


if not INTERPRET:  # defined only on a GPU, so that the interpreter run reports no skips
    LENS = [1, 77, 300, 1000, 5, 640]

    def test_cudnn_frontend_is_installed_here():
        assert cudnn_module._cudnn() is not None, "install the cuDNN frontend: pip install 'vexact-models[cudnn]'"

    @pytest.mark.parametrize("hq,hkv,dtype", [(16, 8, torch.bfloat16), (32, 8, torch.bfloat16), (32, 8, torch.float16)])
    def test_cudnn_backward_matches_triton_and_float64(hq, hkv, dtype):
        q, k, v, cu = _packed(LENS, hq, hkv, 128, dtype, fused_v=True)
        scale, max_seqlen = 128 ** -0.5, max(LENS)
        g = torch.randn_like(q)
        out, lse = attention(q, k, v, packed_layout(cu, max_seqlen), scale, return_lse=True)
        got = attention_backward_cudnn(g, q, k, v, out, lse, cu, max_seqlen, scale)
        triton_ = attention_backward_triton(g, q, k, v, out, lse, cu, max_seqlen, scale)
        for c, t, w, x in zip(got, triton_, _float64(q, k, v, cu, scale, g), (q, k, v)):
            assert c.shape == x.shape and c.dtype == x.dtype and torch.isfinite(c).all()
            close(c, w, BF16_TOL)
            close(c, t, BF16_TOL)

    def test_autograd_auto_picks_cudnn_and_repeats_under_deterministic_algorithms():
        q, k, v, cu = _packed([1, 129, 300], 16, 8, 128, torch.bfloat16, fused_v=True)
        g = torch.randn_like(q)
        assert choose_attention_backward(q, k, v, cu, 300, 0.1) == "cudnn"
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            first, second = (_grads(q, k, v, cu, 300, 0.1, g, "auto") for _ in range(2))
        finally:
            torch.use_deterministic_algorithms(False)
        for a, b, w in zip(first, second, _float64(q, k, v, cu, 0.1, g)):
            assert torch.equal(a, b)
            close(a, w, BF16_TOL)

    def test_many_sequences_and_one_graph_per_shape_class():
        """40 sequences (the graph's batch is 64, the extra sequences empty); a second batch in
        the same shape class reuses the graph."""
        lens = [(37 * i) % 200 + 1 for i in range(40)]
        q, k, v, cu = _packed(lens, 16, 8, 128, torch.bfloat16)
        g = torch.randn_like(q)
        before = len(cudnn_module._graphs)
        for a, w in zip(_grads(q, k, v, cu, max(lens), 0.1, g, "cudnn"), _float64(q, k, v, cu, 0.1, g)):
            close(a, w, BF16_TOL)
        lens2 = [(53 * i) % 190 + 1 for i in range(39)]
        q2, k2, v2, cu2 = _packed(lens2, 16, 8, 128, torch.bfloat16)
        assert cudnn_module.graph_dims(39, max(lens2), sum(lens2)) == cudnn_module.graph_dims(40, max(lens), sum(lens))
        _grads(q2, k2, v2, cu2, max(lens2), 0.1, torch.randn_like(q2), "cudnn")
        assert len(cudnn_module._graphs) == before + 1

    @pytest.mark.parametrize("lens,max_seqlen,dense", [([512], 512, True), ([300] * 3, 300, True),
                                                      ([300] * 3, 320, False)], ids=["one", "equal", "bound"])
    def test_equal_lengths_take_a_dense_graph(lens, max_seqlen, dense):
        """Sequences all of max_seqlen tokens are described densely (no ragged offsets, no
        padding mask); the same lengths under a looser max_seqlen stay ragged. Both correct."""
        q, k, v, cu = _packed(lens, 32, 8, 128, torch.bfloat16, fused_v=True)
        g = torch.randn_like(q)
        assert cudnn_module._graph_key(q, k, v, len(lens), max_seqlen, 0.1)[2] is dense
        got = _grads(q, k, v, cu, max_seqlen, 0.1, g, "cudnn")
        for a, w in zip(got, _float64(q, k, v, cu, 0.1, g)):
            close(a, w, BF16_TOL)
        entry = cudnn_module._graph(cudnn_module._graph_key(q, k, v, len(lens), max_seqlen, 0.1))
        assert ("seq_len_q" not in entry[2]) is dense

    def test_mla_head_dims_take_cudnn_or_fall_back_to_triton():
        """MLA expanded (qk 192, v 128): whichever backward auto picks is correct; a forced cudnn
        either runs correctly or refuses naming cuDNN's reason."""
        q, k, v, cu = _packed([1, 63, 200], 16, 16, 192, torch.bfloat16, dv=128)
        g = torch.randn(q.shape[0], 16, 128, device=DEVICE).bfloat16()
        want = _float64(q, k, v, cu, 0.07, g)
        picked = choose_attention_backward(q, k, v, cu, 200, 0.07)
        print(f"MLA qk 192 / v 128: auto picks {picked}; cuDNN says {cudnn_backward_unavailable_reason(q, k, v, cu, 200, 0.07)}")
        for a, w in zip(_grads(q, k, v, cu, 200, 0.07, g, "auto"), want):
            close(a, w, BF16_TOL)
        if picked == "cudnn":
            for a, w in zip(_grads(q, k, v, cu, 200, 0.07, g, "cudnn"), want):
                close(a, w, BF16_TOL)
        else:
            with pytest.raises(UnsupportedError, match="'cudnn'"):
                _grads(q, k, v, cu, 200, 0.07, g, "cudnn")
