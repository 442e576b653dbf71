"""`kernels.lora_add` on the reference backend: PEFT's update within rounding, the invariances
its contract promises bitwise (a row alone, a stacked group vs its members, in place), its
gradients against float64 autograd, and its errors. The Triton kernels: tests/triton_checks/check_lora.py."""

import pytest
import torch

from vexact_models.kernels import lora_add
from vexact_models.kernels.lora import CHUNK_K, num_chunks


def operands(t=9, k=CHUNK_K + 90, sizes=(24, 8, 8), rank=4, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = torch.randn(len(sizes) * rank, k, generator=g) / k ** 0.5  # fp32 adapters, PEFT's default
    b = torch.randn(sum(sizes), rank, generator=g)
    base = torch.randn(t, sum(sizes), generator=g).to(dtype)
    return base, x, a, b


def peft_update(base, x, a, b, sizes, scalings, bias=None):
    """PEFT's formula in float64 (fp32 A as it is: the shrink keeps 17 of its bits)."""
    out, col, rank = base.double().clone(), 0, b.shape[1]
    for g, (size, s) in enumerate(zip(sizes, scalings)):
        u = x.double() @ a[g * rank:(g + 1) * rank].double().t()
        upd = u @ b[col:col + size].double().t() + (0 if bias is None else bias[col:col + size].double())
        out[:, col:col + size] += upd * s
        col += size
    return out


def test_lora_add_is_pefts_update_within_rounding():
    base, x, a, b = operands(dtype=torch.float32)
    bias = torch.randn(40)
    got = lora_add(base, x, a, b, (2.0, 0.5, 1.0), bias=bias, sizes=(24, 8, 8))
    want = peft_update(base, x, a, b, (24, 8, 8), (2.0, 0.5, 1.0), bias)
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    bf = lora_add(base.bfloat16(), x.bfloat16(), a, b, (2.0, 0.5, 1.0), bias=bias, sizes=(24, 8, 8))
    assert bf.dtype == torch.bfloat16
    want = peft_update(base.bfloat16(), x.bfloat16(), a, b, (24, 8, 8), (2.0, 0.5, 1.0), bias)
    assert (bf.double() - want).abs().max() <= 2 ** -8 * want.abs().max()
    # the shrink alone: fp32 A split into two bf16 halves is within 2**-15 of fp32's product, where
    # A rounded to bf16 is 2**-9 off
    from vexact_models.kernels.lora_reference import lora_shrink_reference, shrink_operand

    x16, u = x.bfloat16(), lora_shrink_reference(x.bfloat16(), a)
    exact = x16.double() @ a.double().t()
    assert (u.double() - exact).abs().max() <= 2 ** -15 * exact.abs().max()
    assert (x16.double() @ a.bfloat16().double().t() - exact).abs().max() > 2 ** -12 * exact.abs().max()
    assert torch.equal(shrink_operand(a.bfloat16(), torch.bfloat16), a.bfloat16())


def test_rows_alone_stacked_members_and_in_place_are_bitwise_the_batch():
    base, x, a, b = operands()
    sizes, scalings = (24, 8, 8), (2.0, 0.5, 1.0)
    got = lora_add(base, x, a, b, scalings, sizes=sizes)
    for i in range(x.shape[0]):
        assert torch.equal(lora_add(base[i:i + 1], x[i:i + 1], a, b, scalings, sizes=sizes), got[i:i + 1])
    col, parts = 0, []
    for g, (size, s) in enumerate(zip(sizes, scalings)):
        parts.append(lora_add(base[:, col:col + size], x, a[4 * g:4 * g + 4], b[col:col + size], (s,)))
        col += size
    assert torch.equal(torch.cat(parts, 1), got)
    fused = base.clone()
    lora_add(fused[:, 24:32], x, a[4:8], b[24:32], (0.5,), inplace=True)  # a column slice of a fused output
    assert torch.equal(fused[:, 24:32], got[:, 24:32]) and torch.equal(fused[:, :24], base[:, :24])
    assert num_chunks(1) == 1 and num_chunks(CHUNK_K) == 1 and num_chunks(CHUNK_K + 1) == 2


def test_gradients_match_float64_autograd():
    base, x, a, b = operands(dtype=torch.float32, t=5, k=70)
    bias = torch.randn(40)
    leaves = [t.clone().requires_grad_() for t in (base, x, a, b, bias)]
    lora_add(leaves[0], leaves[1], leaves[2], leaves[3], (2.0, 0.5, 1.0), bias=leaves[4], sizes=(24, 8, 8)).sum().backward()
    ref = [t.double().clone().requires_grad_() for t in (base, x, a, b, bias)]
    peft_update(*ref[:4], (24, 8, 8), (2.0, 0.5, 1.0), ref[4]).sum().backward()
    for got, want in zip(leaves, ref):
        assert got.grad.dtype == got.dtype and torch.allclose(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(sizes=(20, 8, 8)), "shapes do not match"),
    (dict(scalings=(1.0, 2.0)), "3 members with 2 scalings"),
    (dict(sizes=(8,) * 5, scalings=(1.0,) * 5), "5 members"),
    (dict(bias=torch.zeros(3)), "bias \\(3,\\)"),
])
def test_errors_name_the_mismatch(change, message):
    base, x, a, b = operands()
    args = dict(sizes=(24, 8, 8), scalings=(1.0, 1.0, 1.0), bias=None) | change
    with pytest.raises(ValueError, match=message):
        lora_add(base, x, a, b, **args)


def test_in_place_while_a_gradient_flows_is_an_error():
    base, x, a, b = operands()
    with pytest.raises(ValueError, match="inplace=True while a gradient flows"):
        lora_add(base, x, a.requires_grad_(), b, (1.0, 1.0, 1.0), sizes=(24, 8, 8), inplace=True)


def test_partials_are_refused_where_lora_add_would_not_read_them():
    """`lora_add`'s ``partials`` (a shrink begun beside the base GEMM): the shape and dtype of this
    shrink's partials or of u summed from them, the Triton backend, no gradient; each error names what is wrong, and
    `lora_partials` gives None where the reference backend runs (which takes none)."""
    from vexact_models.kernels import lora_partials, use_backend

    base, x, a, b = torch.zeros(5, 8), torch.zeros(5, CHUNK_K + 3), torch.zeros(4, CHUNK_K + 3), torch.zeros(8, 4)
    good = torch.zeros(num_chunks(CHUNK_K + 3), 5, 4)
    with pytest.raises(ValueError, match=r"partials \(3, 5, 4\) torch.float32 must be \(2, 5, 4\) or \(1, 5, 4\) "
                                         "float32"):
        lora_add(base, x, a, b, (1.0,), partials=torch.zeros(3, 5, 4))
    with pytest.raises(ValueError, match="must be .* float32"):
        lora_add(base, x, a, b, (1.0,), partials=good.double())
    with use_backend("reference"):
        assert lora_partials(x, a) is None
        with pytest.raises(ValueError, match="partials are the Triton shrink's; this call runs the reference"):
            lora_add(base, x, a, b, (1.0,), partials=good)
    with use_backend("triton"), pytest.raises(ValueError, match="partials while a gradient flows"):
        lora_add(base, x, a, b.requires_grad_(), (1.0,), partials=good)


def test_expand_tile_by_the_call_shape():
    """The expand's tile (a speed choice; every tile gives the same bits: check_lora.py): decode
    rows take the widest tile that still makes `EXPAND_MIN_PROGRAMS` programs, mid rows 128
    columns for a stacked group and 64 for one member, more rows the default."""
    from vexact_models.kernels.lora_expand import EXPAND_MIN_PROGRAMS, ExpandTile, expand_tile

    assert EXPAND_MIN_PROGRAMS == 96
    assert expand_tile(32, 4096, 3) == ExpandTile(32, 32, 4)  # Qwen3-0.6B q/k/v: 128 programs
    assert expand_tile(32, 6144, 3) == ExpandTile(32, 64, 4)  # Qwen3-8B q/k/v: 96
    assert expand_tile(32, 24576, 2) == ExpandTile(32, 128, 4)  # Qwen3-8B gate/up: 192
    assert expand_tile(64, 6144, 2) == ExpandTile(32, 128, 4)  # two row tiles x 48 column tiles
    assert expand_tile(64, 4096, 2) == ExpandTile(32, 64, 4)  # 2 x 32 of 128 columns too few, 2 x 64 of 64 not
    assert expand_tile(1, 1024, 1) == expand_tile(0, 1024, 1) == ExpandTile(32, 32, 4)
    assert expand_tile(65, 4096, 3) == expand_tile(512, 4096, 3) == ExpandTile(32, 128, 4)
    assert expand_tile(256, 4096, 1) == ExpandTile(32, 64, 4)
    assert expand_tile(513, 4096, 1) == expand_tile(8192, 1024, 1) == ExpandTile()
