"""head_linear (MLA's absorption GEMMs, one per head) on the reference backend: values against
float64, rows independent of the batch (bitwise), strided weight views, the backward, errors."""

import pytest
import torch

from vexact_models.kernels import head_linear

from ..conftest import rel_err


def _absorbed(heads=3, nope=8, v_dim=6, rank=16, dtype=torch.float32):
    """The two weights the latent MLA mode reads: strided views of one kv_b_proj weight."""
    weight = torch.randn(heads * (nope + v_dim), rank).to(dtype).view(heads, nope + v_dim, rank)
    return weight, weight[:, :nope].transpose(1, 2), weight[:, nope:]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_values_match_float64_on_strided_views(dtype):
    _, w_uk_t, w_uv = _absorbed(dtype=dtype)
    q = torch.randn(9, 3, 8 + 4).to(dtype)[:, :, :8]  # a slice of the query, as the model passes it
    o = torch.randn(9, 3, 16).to(dtype)
    for x, w in ((q, w_uk_t), (o, w_uv)):
        out = head_linear(x, w)
        want = torch.einsum("thk,hnk->thn", x.double(), w.double())
        assert out.dtype == dtype and out.shape == (9, 3, w.shape[1]) and out.is_contiguous()
        assert rel_err(out, want) < {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]


def test_rows_do_not_depend_on_the_batch():
    _, w_uk_t, _ = _absorbed()
    x = torch.randn(40, 3, 8)
    full = head_linear(x, w_uk_t)
    for m in (1, 2, 17, 40):
        assert torch.equal(head_linear(x[:m], w_uk_t), full[:m])
    perm = torch.randperm(40)
    assert torch.equal(head_linear(x[perm], w_uk_t), full[perm])


def test_backward_matches_autograd_into_the_shared_weight():
    weight, w_uk_t, w_uv = _absorbed(dtype=torch.float64)
    weight.requires_grad_()
    w_uk_t, w_uv = weight[:, :8].transpose(1, 2), weight[:, 8:]
    q = torch.randn(7, 3, 8, dtype=torch.float64, requires_grad=True)
    out = head_linear(head_linear(q, w_uk_t), w_uv)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, weight), g)
    want_out = torch.einsum("thk,hnk->thn", torch.einsum("thk,hnk->thn", q, w_uk_t), w_uv)
    want = torch.autograd.grad(want_out, (q, weight), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)


def test_shape_and_dtype_errors():
    x, w = torch.randn(4, 3, 8), torch.randn(3, 5, 8)
    with pytest.raises(ValueError, match=r"weight \(2, 5, 8\) does not fit x \(4, 3, 8\)"):
        head_linear(x, torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="must be \\[T, H, K\\]"):
        head_linear(x[0], w)
    with pytest.raises(ValueError, match="weight dtype torch.float64 must equal input dtype torch.float32"):
        head_linear(x, w.double())
