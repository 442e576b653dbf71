import pytest
import torch

from vexact_models.kernels import silu_and_mul

from ..conftest import rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_silu_and_mul_matches_float64(dtype):
    g, u = torch.randn(17, 300).to(dtype) * 4, torch.randn(17, 300).to(dtype)
    out = silu_and_mul(g, u)
    ref = torch.nn.functional.silu(g.double()) * u.double()
    assert out.dtype == dtype
    assert rel_err(out, ref) < {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]


def test_silu_and_mul_rows_invariant_to_batch():
    g, u = torch.randn(64, 257), torch.randn(64, 257)
    single = torch.cat([silu_and_mul(g[i:i + 1], u[i:i + 1]) for i in range(64)])
    assert torch.equal(silu_and_mul(g, u), single)


def test_silu_and_mul_backward():
    g = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    u = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    go = torch.randn(5, 12, dtype=torch.float64)
    got = torch.autograd.grad(silu_and_mul(g, u), (g, u), go)
    want = torch.autograd.grad(torch.nn.functional.silu(g) * u, (g, u), go)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)


def test_silu_and_mul_shape_error():
    with pytest.raises(ValueError, match="must match"):
        silu_and_mul(torch.randn(2, 3), torch.randn(2, 4))


@pytest.mark.parametrize("block,warps,words", [(48, None, "block=48 must be a power of two from 64 to 8192"),
                                               (16384, None, "block=16384 must be a power of two from 64 to 8192"),
                                               (None, 3, "num_warps=3 must be 1, 2, 4 or 8")])
def test_silu_and_mul_triton_refuses_bad_launch_shapes(block, warps, words):
    """The launch shape a sweep passes is checked before anything needs Triton or a GPU."""
    from vexact_models.kernels.silu_and_mul import silu_and_mul_triton

    with pytest.raises(ValueError, match=f"silu_and_mul: {words}"):
        silu_and_mul_triton(torch.randn(2, 64), torch.randn(2, 64), block, warps)


def test_silu_and_mul_takes_row_strided_halves():
    """The two halves of one fused gate/up GEMM's output, without copies first."""
    fused = torch.randn(7, 2 * 48)
    gate, up = fused.split(48, dim=-1)
    assert gate.stride(0) == 96
    assert torch.equal(silu_and_mul(gate, up), silu_and_mul(gate.contiguous(), up.contiguous()))
