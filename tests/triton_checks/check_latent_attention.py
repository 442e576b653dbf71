"""The latent MLA attention and head_linear Triton kernels vs the reference, on small shapes.

Run like check_triton_kernels.py: under TRITON_INTERPRET=1 VEXACT_BACKEND=triton on CPU (kernel
logic: the key split into latent + rope dims, the value read from the key, paging, the folded
value gradient), or on a GPU, where paged == packed is also bitwise.
"""

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (INTERPRET and os.environ.get("VEXACT_BACKEND") == "triton") and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1 VEXACT_BACKEND=triton", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
#: fp32 tolerance of the attention checks: on the GPU tl.dot rounds fp32 inputs to TF32, as
#: kernels.attention does (check_triton_kernels.py accepts 2e-2 there); the interpreter is exact.
FP32_TOL = 1e-5 if INTERPRET else 2e-2

from vexact_models.kernels import attention, attention_packed, use_backend  # noqa: E402
from vexact_models.kernels.attention_backward import attention_math  # noqa: E402
from vexact_models.kernels.head_linear import head_linear  # noqa: E402
from vexact_models.kernels.latent_attention import (  # noqa: E402
    LatentConfig, key_block, latent_attention_triton, pick_config, value_in_key)
from vexact_models.kernels.latent_attention_backward import latent_attention_backward_triton  # noqa: E402
from vexact_models.kernels.attention import packed_layout  # noqa: E402
from vexact_models.kernels.paged_layout import shuffled_block_table  # noqa: E402

# pytest's importlib mode does not put this folder on sys.path (check_triton_kernels.py's helpers)
sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import last_tokens, write_pages  # noqa: E402


def close(a, b, tol):
    a, b = a.double().cpu(), b.double().cpu()
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    assert err < tol, err


def _latent(lens, heads, lat, rope, dtype):
    t = sum(lens)
    q = torch.randn(t, heads, lat + rope, device=DEVICE).to(dtype)
    k = torch.randn(t, 1, lat + rope, device=DEVICE).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    return q, k, cu


@pytest.mark.parametrize("page_size", [8, 12])  # slots by shift and mask; by division
@pytest.mark.parametrize("heads,lat,rope,dtype", [(4, 32, 16, torch.float32), (3, 16, 8, torch.float32),
                                                 (4, 32, 16, torch.bfloat16)])
def test_latent_attention_packed_and_paged(heads, lat, rope, dtype, page_size):
    lens = [1, 20, 45]
    q, k, cu = _latent(lens, heads, lat, rope, dtype)
    v = k[..., :lat]
    assert value_in_key(k, v)
    packed = attention_packed(q, k, v, cu, 45, 0.2)
    want = attention_math(q.double(), k.double(), v.double(), cu, 0.2)
    close(packed, want, FP32_TOL if dtype == torch.float32 else 2e-2)
    # the last 6 tokens of each sequence as a chunk over a paged latent cache (V a view of K)
    table = shuffled_block_table(lens, page_size, torch.Generator().manual_seed(page_size)).to(DEVICE)
    k_cache = torch.full((10, page_size, 1, lat + rope), float("nan"), device=DEVICE, dtype=dtype)
    v_cache = k_cache[..., :lat]
    write_pages(k, v, k_cache, v_cache, table, lens)
    idx, layout = last_tokens(lens, 6, table, page_size)
    paged = attention(q[idx], k_cache, v_cache, layout, 0.2)
    assert torch.equal(paged, packed[idx])  # one kernel, other tiles: bitwise (rule 2)
    # the order programs take the sequences (PagedLayout.seq_order, the engine's longest first) moves no bit
    for order in ([2, 1, 0], [1, 2, 0]):
        ordered = dataclasses.replace(layout, seq_order=torch.tensor(order, dtype=torch.int32, device=DEVICE))
        assert torch.equal(attention(q[idx], k_cache, v_cache, ordered, 0.2), paged), order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_launch_parameters_leave_the_output_unchanged(dtype):
    """Rows per program, warps, stages and value chunks only move work between programs: every
    candidate gives bitwise the default's output (rule 2; the softmax denominators are summed in
    one fixed order, so on the GPU 16-row mma.sync tiles equal 64-row wgmma ones; under the
    interpreter, conftest.py's dot sums each element in k order whatever the tile). A chunk count
    that does not divide the value tile is refused."""
    lens, heads, lat, rope = [1, 20, 37], 4, 32, 16
    q, k, cu = _latent(lens, heads, lat, rope, dtype)
    layout = packed_layout(cu, max(lens))
    want, want_lse = latent_attention_triton(q, k, lat, layout, 0.2)
    blk = key_block(dtype)
    if dtype == torch.float32:
        configs = (LatentConfig(16, blk, 4, 1, 2), LatentConfig(16, blk, 4, 2, 4), LatentConfig(16, blk, 4, 2, 1))
    else:  # the candidates `conformance/kernel_invariance.py` ("attention configs") proves on the GPU
        configs = (LatentConfig(64, blk, 4, 1), LatentConfig(64, blk, 8, 1, 2), LatentConfig(64, blk, 4, 1, 4),
                   LatentConfig(128, blk, 8, 1), LatentConfig(16, blk, 4, 2), LatentConfig(16, blk, 8, 2),
                   LatentConfig(32, blk, 4, 2))
    for cfg in configs:
        out, lse = latent_attention_triton(q, k, lat, layout, 0.2, cfg)
        assert torch.equal(out, want), cfg
        assert torch.equal(lse, want_lse), cfg
    with pytest.raises(ValueError, match="value_chunks=3"):
        latent_attention_triton(q, k, lat, layout, 0.2, LatentConfig(16, blk, 4, 1, 3))
    assert pick_config(dtype, 1, 1, 132).block_n == pick_config(dtype, 4096, 1, 132).block_n == blk


def test_latent_backward_configs_agree():
    """The backward's launch parameters are free (rule 8): other tiles give the same gradients
    up to rounding."""
    lens, lat, rope = [3, 40], 32, 16
    q, k, cu = _latent(lens, 4, lat, rope, torch.float32)
    layout = packed_layout(cu, 40)
    out, lse = latent_attention_triton(q, k, lat, layout, 0.15)
    g = torch.randn_like(out)
    want = latent_attention_backward_triton(g, q, k, out, lse, cu, 40, 0.15)
    got = latent_attention_backward_triton(g, q, k, out, lse, cu, 40, 0.15, (16, 16, 4, 2), (16, 32, 4, 2))
    for a, b in zip(got, want):
        close(a, b, FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_attention_backward(dtype):
    lens = [3, 40]
    lat, rope = 32, 16
    q, k, cu = _latent(lens, 4, lat, rope, dtype)
    q.requires_grad_(), k.requires_grad_()
    g = torch.randn(q.shape[0], 4, lat, device=DEVICE).to(dtype)
    got = torch.autograd.grad(attention_packed(q, k, k[..., :lat], cu, 40, 0.15), (q, k), g)
    qd, kd = (x.detach().double().requires_grad_() for x in (q, k))
    want = torch.autograd.grad(attention_math(qd, kd, kd[..., :lat], cu, 0.15), (qd, kd), g.double())
    for a, b in zip(got, want):
        close(a, b, FP32_TOL if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_linear(dtype):
    """Both absorption GEMMs on strided views of one [H, nope + v, rank] weight, as the model runs them."""
    base = torch.randn(3, 24 + 40, 48, device=DEVICE).to(dtype)
    w_uk_t, w_uv = base[:, :24].transpose(1, 2), base[:, 24:]  # [3, 48, 24] (K strided), [3, 40, 48]
    q = torch.randn(70, 3, 24 + 16, device=DEVICE).to(dtype)[:, :, :24]  # a strided slice of the query
    o = torch.randn(70, 3, 48, device=DEVICE).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for x, w in ((q, w_uk_t), (o, w_uv)):
        got = head_linear(x, w)
        with use_backend("reference"):
            want = head_linear(x.cpu(), w.cpu())
        close(got, want, tol)
        assert torch.equal(head_linear(x[5:6], w), got[5:6])  # rows alone == rows in the batch (rule 1)


def test_head_linear_tiles_give_the_same_bits():
    """Any (BLOCK_M, BLOCK_N, warps, stages) runs the same K loop per output (rule 1), so other
    tiles give the default's bits: what `benchmarks/investigations/head_linear.py` checks on the GPU
    as it times them, its sweep run here with a stand-in timer. Strided views as the model passes them."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "investigations"))
    import head_linear as bench

    from vexact_models.kernels.head_linear import config, head_linear_triton

    base = torch.randn(3, 24 + 40, 48, device=DEVICE).bfloat16()
    w_uk_t, w_uv = base[:, :24].transpose(1, 2), base[:, 24:]
    tiles = [config(torch.bfloat16), (16, 32, 2, 2), (32, 64, 4, 3), (16, 128, 4, 4)]
    for x, w in ((torch.randn(37, 3, 24, device=DEVICE).bfloat16(), w_uk_t),
                 (torch.randn(37, 3, 48, device=DEVICE).bfloat16(), w_uv)):
        want = head_linear(x, w)
        for tile in tiles:
            assert torch.equal(head_linear_triton(x, w, tile), want), tile
        rows = bench.sweep_rows(x, w, tiles, lambda fn: (fn(), 2.0)[1])
        assert [r[0] for r in rows] == ["cuBLAS bmm (peer)", "64x64x4x3 (reference)", "16x32x2x2", "32x64x4x3",
                                        "16x128x4x4"]
        assert [r[3] for r in rows[1:]] == ["yes"] * 4 and rows[1][2] == "1.00x"
    with pytest.raises(ValueError, match=r"tile=\(48, 64, 4, 3\) must be"):
        head_linear_triton(x, w, (48, 64, 4, 3))
