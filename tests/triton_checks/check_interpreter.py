"""conftest.py's premises about Triton's interpreter, each pinned through a kernel: fp32 -> bf16
conversions round to nearest even as the GPU's do, and the bitwise reductions it runs as numpy's
(``tl.xor_sum``, ``tl.reduce_or``) are exact. Run like check_triton_kernels.py: on CPU under the
interpreter (TRITON_INTERPRET=1 VEXACT_BACKEND=triton), or on a GPU, where the compiled kernels
must give the same values."""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE  # noqa: E402


def test_interpreter_rounds_bf16_to_nearest_even_as_the_gpu():
    """conftest.py's premise, pinned through a kernel's store: an fp32 -> bf16 conversion rounds to
    nearest even (the GPU's ``cvt.rn.bf16.f32``, torch's), ties to the even neighbour, and a
    carry into the exponent, where triton 3.6's own interpreter truncates."""
    from vexact_models.kernels.moe import moe_align
    from vexact_models.kernels.moe_grouped_gemm import combine

    values = torch.tensor([1.0 + 3 * 2 ** -9, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 2.0 - 2 ** -9, -(1.0 + 3 * 2 ** -9)])
    layout = moe_align(torch.zeros(len(values), 1, dtype=torch.int64, device=DEVICE), 1, 16)  # a row each
    y = torch.zeros(16, 1, device=DEVICE)
    y[layout.pair_pos.long()] = values[:, None].to(DEVICE)
    out = combine(y, torch.ones(len(values), 1, device=DEVICE), layout, len(values), torch.bfloat16)
    assert out[:, 0].tolist() == [1.0 + 2 ** -7, 1.0, 1.0 + 2 ** -6, 2.0, -(1.0 + 2 ** -7)]
    assert torch.equal(out[:, 0].cpu(), values.bfloat16())


@triton.jit
def _bitwise_reductions_kernel(x_ptr, xor_rows_ptr, or_cols_ptr, xor_all_ptr, R: tl.constexpr, C: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    tl.store(xor_rows_ptr + tl.arange(0, R)[:, None], tl.xor_sum(x, 1, keep_dims=True))
    tl.store(or_cols_ptr + tl.arange(0, C), tl.reduce_or(x, 0))
    tl.store(xor_all_ptr, tl.xor_sum(x))


def test_interpreter_bitwise_reductions_are_exact():
    """``tl.xor_sum`` over rows (dims kept), over everything, and ``tl.reduce_or`` over columns, on
    int64 values with every bit in play: numpy's reductions of the same values (conftest.py runs
    these two reductions as numpy's under the interpreter; on a GPU, the compiled kernel)."""
    import numpy as np

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-(2 ** 62), 2 ** 62, (8, 16), generator=gen, dtype=torch.int64)
    xor_rows = torch.empty(8, 1, dtype=torch.int64, device=DEVICE)
    or_cols = torch.empty(16, dtype=torch.int64, device=DEVICE)
    xor_all = torch.empty(1, dtype=torch.int64, device=DEVICE)
    _bitwise_reductions_kernel[(1,)](x.to(DEVICE), xor_rows, or_cols, xor_all, R=8, C=16)
    values = x.numpy()
    assert xor_rows.cpu().numpy().tolist() == np.bitwise_xor.reduce(values, axis=1, keepdims=True).tolist()
    assert or_cols.cpu().numpy().tolist() == np.bitwise_or.reduce(values, axis=0).tolist()
    assert xor_all.item() == int(np.bitwise_xor.reduce(values, axis=None))
