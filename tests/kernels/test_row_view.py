"""kernels.row_view: the rows the row-wise kernels address, a view wherever one exists (`as_rows`),
and their outputs back in the input's shape, a view only where the shape differs (`in_shape`)."""

import torch

from vexact_models.kernels.row_view import as_rows, in_shape


def test_as_rows_keeps_strided_views_and_copies_only_strided_columns():
    fused = torch.randn(3, 5, 40)
    columns = fused[..., 8:24]  # a fused projection's member: rows strided, columns consecutive
    rows = as_rows(columns)
    assert rows.shape == (15, 16) and rows.data_ptr() == columns.data_ptr() and torch.equal(rows, columns.reshape(15, 16))
    heads = torch.randn(4, 6, 8)[:, 1:5]  # [tokens, heads, dim] view: rows of heads * dim
    assert as_rows(heads, 4 * 8).shape == (4, 32) and torch.equal(as_rows(heads, 32), heads.reshape(4, 32))
    transposed = torch.randn(16, 6).t()  # columns 16 apart: no such view, a copy
    copied = as_rows(transposed)
    assert copied.stride() == (16, 1) and torch.equal(copied, transposed)


def test_in_shape_returns_the_tensor_itself_where_the_shape_agrees():
    out = torch.randn(6, 8, requires_grad=True) * 2  # a kernel's [rows, n] output
    assert in_shape(out, (6, 8)) is out and in_shape(out, torch.Size([6, 8])) is out
    assert out.reshape(6, 8)._base is out  # what a plain reshape would give: a view
    back = in_shape(out, (2, 3, 8))
    assert back.shape == (2, 3, 8) and back._base is out and torch.equal(back.reshape(6, 8), out)
