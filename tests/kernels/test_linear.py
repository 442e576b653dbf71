import pytest
import torch

from vexact_models.kernels import linear
from vexact_models.kernels.linear import BLOCK_K, LinearConfig, linear_reference, pick_config

from ..conftest import rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(dtype, bias):
    x = torch.randn(37, 96).to(dtype)
    w = torch.randn(50, 96).to(dtype)
    b = torch.randn(50).to(dtype) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    out = linear(x, w, b)
    assert out.dtype == dtype and out.shape == (37, 50)
    assert rel_err(out, ref) < {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]


def test_linear_fp32_output_keeps_accumulator():
    x, w = torch.randn(9, 64).bfloat16(), torch.randn(33, 64).bfloat16()
    out = linear(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert rel_err(out, x.double() @ w.double().T) < 1e-6  # bf16 products are exact in fp32


def test_linear_leading_dims():
    x, w = torch.randn(2, 3, 16), torch.randn(8, 16)
    assert linear(x, w).shape == (2, 3, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_invariant_to_batch(dtype):
    """Rows for M = 1..64 equal the M=1 rows, bitwise."""
    x = torch.randn(64, 256).to(dtype)
    w = torch.randn(96, 256).to(dtype)
    single = torch.cat([linear(x[i:i + 1], w) for i in range(64)])
    for m in range(1, 65):
        assert torch.equal(linear(x[:m], w), single[:m]), f"M={m}"


def test_linear_backward_matches_autograd():
    x = torch.randn(11, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 24, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    g = torch.randn(11, 7, dtype=torch.float64)
    grads = torch.autograd.grad(linear(x, w, b), (x, w, b), g)
    ref = torch.autograd.grad(torch.nn.functional.linear(x, w, b), (x, w, b), g)
    for got, want in zip(grads, ref):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_linear_errors_name_the_problem():
    with pytest.raises(ValueError, match="16 features but weight expects 8"):
        linear(torch.randn(2, 16), torch.randn(4, 8))
    with pytest.raises(ValueError, match="weight dtype"):
        linear(torch.randn(2, 8), torch.randn(4, 8).double())


def test_configs_share_block_k_and_use_wgmma_tiles():
    for m in (1, 7, 64, 65, 256, 257, 8192):
        cfg = pick_config(m, 4096, 4096, torch.bfloat16)
        assert cfg.block_m >= 64 and cfg.num_warps % 4 == 0
    assert BLOCK_K == 64


def test_every_picked_config_is_in_the_gpu_invariance_check():
    """The GPU check ("linear configs") covers every config pick_config can return, so a new
    branch of the table cannot ship unproven; all of them use wgmma tiles (>= 64 rows)."""
    from vexact_models.conformance.linear_invariance import picked_linear_configs

    picked = picked_linear_configs()
    assert all(c.block_m >= 64 and c.num_warps % 4 == 0 for c in picked)
    # the H200 decode branches: TMA from 129 rows, the LM head persistent, wide N with short K at M <= 64
    assert pick_config(256, 4096, 4096, torch.bfloat16) in picked and pick_config(256, 4096, 4096, torch.bfloat16).tma
    assert pick_config(128, 151936, 4096, torch.bfloat16).persistent
    assert pick_config(16, 24576, 1536, torch.bfloat16).block_n == 128
    assert pick_config(16, 24576, 7168, torch.bfloat16).block_n == 64
    # a partly filled last row tile (the 160 and 224 graph buckets): pointer loads on long-K weights
    for m in (160, 224):
        assert not pick_config(m, 4096, 12288, torch.bfloat16).tma and pick_config(m, 4096, 12288, torch.bfloat16) in picked
        assert pick_config(m, 4096, 1024, torch.bfloat16).tma  # short K keeps TMA
    assert pick_config(160, 24576, 4096, torch.bfloat16) == LinearConfig(128, 128, 8, 4)
    assert pick_config(160, 24576, 4096, torch.bfloat16) in picked
    assert pick_config(224, 24576, 4096, torch.bfloat16).persistent
    assert pick_config(192, 4096, 12288, torch.bfloat16).tma  # full row tiles: as before


def test_reference_chunks_rows_without_changing_them():
    x, w = torch.randn(300, 64), torch.randn(700, 64)  # forces several row chunks
    out = linear_reference(x, w, None, torch.float32)
    assert torch.equal(out[250:], linear_reference(x[250:], w, None, torch.float32))
