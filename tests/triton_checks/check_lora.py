"""`lora_add`'s Triton kernels (shrink partials, the expand that adds them up in chunk order)
against the reference, under TRITON_INTERPRET=1 on CPU and on a GPU: close to the reference, and
bitwise what the contract promises of the kernels themselves (a row alone equals the row in a
batch, a stacked group equals its members' separate calls, in place equals out of place); the
two-launch path bitwise the three-launch one (the partials' sum in a launch of its own) and the
CPU reference's expand on the same partials."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels import lora_add, lora_partials, use_backend  # noqa: E402
from vexact_models.kernels.lora import lora_partials_triton, lora_shrink_triton  # noqa: E402
from vexact_models.kernels.lora_expand import lora_expand_triton  # noqa: E402
from vexact_models.kernels.lora_reference import CHUNK_K, lora_expand_reference, lora_shrink_reference  # noqa: E402

SCALINGS = (2.0, 0.5, 1.5)
# fp32 adapter weights with bf16 activations (PEFT's default: A split into two bf16 halves in
# the shrink) and bf16 ones
ADAPTER_DTYPES = [torch.bfloat16, torch.float32]


def operands(t, k, sizes, rank, dtype, adapter_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = (torch.randn(len(sizes) * rank, k, generator=g) / k ** 0.5).to(adapter_dtype)
    b = torch.randn(n, rank, generator=g).to(adapter_dtype)
    base = torch.randn(t, n, generator=g).to(dtype)
    return [v.to(DEVICE) for v in (base, x, a, b)]


@pytest.mark.parametrize("k", [64, 300, CHUNK_K, 2 * CHUNK_K + 70])
@pytest.mark.parametrize("dtype, adapter_dtype", [(torch.float32, torch.float32)]
                         + [(torch.bfloat16, d) for d in ADAPTER_DTYPES])
def test_shrink_is_close_to_the_reference_and_rows_are_alone(k, dtype, adapter_dtype):
    _, x, a, _ = operands(21, k, (40, 24), 8, dtype, adapter_dtype)
    u = lora_shrink_triton(x, a)
    want = lora_shrink_reference(x.cpu(), a.cpu())
    assert u.dtype == torch.float32 and u.shape == (21, 16)
    assert torch.allclose(u.cpu(), want, rtol=1e-4, atol=1e-4)
    for i in (0, 7, 20):
        assert torch.equal(lora_shrink_triton(x[i:i + 1], a), u[i:i + 1])


@pytest.mark.parametrize("sizes", [(40,), (48, 16, 16), (130, 70)])
@pytest.mark.parametrize("dtype, adapter_dtype", [(torch.float32, torch.float32)]
                         + [(torch.bfloat16, d) for d in ADAPTER_DTYPES])
def test_lora_add_matches_the_reference_and_stacked_equals_separate(sizes, dtype, adapter_dtype):
    base, x, a, b = operands(19, 200, sizes, 4, dtype, adapter_dtype)
    scalings = SCALINGS[:len(sizes)]
    bias = torch.randn(sum(sizes)).to(DEVICE)
    with use_backend("triton"):
        got = lora_add(base, x, a, b, scalings, bias=bias, sizes=sizes)
        col, parts = 0, []
        for g, (size, s) in enumerate(zip(sizes, scalings)):
            parts.append(lora_add(base[:, col:col + size], x, a[4 * g:4 * (g + 1)], b[col:col + size], (s,),
                                  bias=bias[col:col + size]))
            col += size
        alone = lora_add(base[5:6], x[5:6], a, b, scalings, bias=bias, sizes=sizes)
        inplace = base.clone()
        assert lora_add(inplace, x, a, b, scalings, bias=bias, sizes=sizes, inplace=True).data_ptr() == inplace.data_ptr()
    with use_backend("reference"):
        want = lora_add(base.cpu(), x.cpu(), a.cpu(), b.cpu(), scalings, bias=bias.cpu(), sizes=sizes)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.cpu().float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(torch.cat(parts, dim=1), got)
    assert torch.equal(alone, got[5:6]) and torch.equal(inplace, got)


# the stacked groups the models fuse, tiny: q/k/v with GQA's narrower k and v (k across the
# first 128-column tile's edge), gate/up, the gated-DeltaNet's four-member in_proj (qkv, z, b, a),
# and a lone o/down
GROUPS = [(96, 48, 48), (160, 160), (160, 64, 8, 8), (200,)]


DTYPES = [(torch.bfloat16, d) for d in ADAPTER_DTYPES] + [(torch.float32, torch.float32)]
# 1 and 37 rows everywhere; 300 (ten 32-row expand tiles, the last part empty) at PEFT's default
# dtypes (the interpreter takes seconds a call there)
CASES = [(t, sizes, *d) for t in (1, 37) for sizes in GROUPS for d in DTYPES] \
    + [(300, sizes, torch.bfloat16, torch.float32) for sizes in GROUPS[:3]]


@pytest.mark.parametrize("t, sizes, dtype, adapter_dtype", CASES, ids=str)
def test_expand_adding_the_partials_is_bitwise_the_three_launches_and_the_reference(t, sizes, dtype, adapter_dtype):
    """`lora_add`'s two launches (the shrink's partials, the expand adding them in chunk order)
    give bitwise the output of three (the shrink, `_lora_reduce_kernel`'s u, the expand of u) and
    of the CPU reference's expand of the same partials added in chunk order; the u the expand
    keeps for the backward is bitwise the reduce's. K is not a multiple of the chunk (3 chunks)."""
    k, rank = 2 * CHUNK_K + 70, 4
    base, x, a, b = operands(t, k, sizes, rank, dtype, adapter_dtype, seed=t)
    scalings = SCALINGS[:len(sizes)] + (0.75,) * (len(sizes) - len(SCALINGS))
    bias = torch.randn(sum(sizes)).to(DEVICE)
    with use_backend("triton"):
        got = lora_add(base, x, a, b, scalings, bias=bias, sizes=sizes)
    partials = lora_partials_triton(x, a)
    assert partials.shape == (3, t, len(sizes) * rank)
    u = lora_shrink_triton(x, a)  # the three-launch path: the reduce kernel, then the expand of u
    three = lora_expand_triton(base, u[None], b, bias, sizes, scalings, torch.empty_like(base))
    kept = torch.full_like(u, float("nan"))
    two = lora_expand_triton(base, partials, b, bias, sizes, scalings, torch.empty_like(base), kept)
    assert torch.equal(got, three) and torch.equal(two, three) and torch.equal(kept, u)
    u_ref = partials[0].cpu()
    for p in partials[1:]:
        u_ref = u_ref + p.cpu()
    assert torch.equal(u_ref, u.cpu())
    exact = torch.empty(base.shape, dtype=torch.float32)  # the reference before its last rounding
    lora_expand_reference(base.cpu(), u_ref, b.cpu(), bias.cpu(), sizes, scalings, exact)
    assert torch.equal(got.cpu(), exact.to(dtype))  # rounded once, as torch rounds (conftest.py on CPU)


def test_training_forward_keeps_the_reduces_u_for_the_backward():
    """With a gradient flowing, the expand also stores u (from its first N tile's programs): the
    output is the rollout's bitwise and B's gradient, ``(grad * s_g)^T u_g``, is computed from
    bitwise the u of `lora_shrink_triton` (the reduce kernel's)."""
    sizes, scalings, rank = (160, 64, 8, 8), (2.0, 0.5, 1.5, 0.75), 4
    base, x, a, b = operands(37, CHUNK_K + 70, sizes, rank, torch.bfloat16)
    with use_backend("triton"):
        rollout = lora_add(base, x, a, b, scalings, sizes=sizes)
        b_leaf = b.clone().requires_grad_()
        trained = lora_add(base, x, a, b_leaf, scalings, sizes=sizes)
        grad = torch.randn(trained.shape).to(trained.dtype).to(DEVICE)
        trained.backward(grad)
    assert torch.equal(trained.detach(), rollout)
    u, col = lora_shrink_triton(x, a), 0  # the backward's own operations on the reduce's u
    gs = grad.float() * torch.cat([torch.full((size,), s, device=DEVICE) for size, s in zip(sizes, scalings)])
    for g, size in enumerate(sizes):
        assert torch.equal(b_leaf.grad[col:col + size], gs[:, col:col + size].t() @ u[:, g * rank:(g + 1) * rank]), g
        col += size


@pytest.mark.parametrize("reduce_from,chunks", [(8, 3), (3, 1)])
def test_lora_add_from_partials_begun_elsewhere_is_bitwise_the_whole_call(monkeypatch, reduce_from, chunks):
    """`lora_add(..., partials=lora_partials(x, a))` (a rollout begins the shrink beside the base
    GEMM, `side_stream.shrink_beside`) is bitwise the call that runs its own shrink, in place and
    not, for a stacked group, whether `lora_partials` hands over the partials or, from
    `REDUCE_BESIDE_CHUNKS` chunks on, u summed from them; it takes any leading shape of x."""
    from vexact_models.kernels import lora as lora_module

    monkeypatch.setattr(lora_module, "REDUCE_BESIDE_CHUNKS", reduce_from)
    sizes, scalings, rank = (160, 64, 8), (2.0, 0.5, 1.5), 4
    base, x, a, b = operands(37, 2 * CHUNK_K + 70, sizes, rank, torch.bfloat16)
    with use_backend("triton"):
        whole = lora_add(base, x, a, b, scalings, sizes=sizes)
        partials = lora_partials(x[None], a)
        assert partials.shape == (chunks, 37, len(sizes) * rank)
        assert torch.equal(lora_add(base, x, a, b, scalings, sizes=sizes, partials=partials), whole)
        inplace = base.clone()
        lora_add(inplace, x, a, b, scalings, sizes=sizes, inplace=True, partials=partials)
    assert torch.equal(inplace, whole)


@pytest.mark.parametrize("rank", [16, 20, 37])
@pytest.mark.parametrize("sizes", [(96, 48, 48), (160, 64, 8, 8), (200,)], ids=str)
def test_expand_over_rank_blocks_is_the_reference(rank, sizes):
    """Ranks of one whole `EXPAND_RANK_BLOCK`, of a block and a part (20) and of several blocks
    (37): the expand that walks each block's ranks in registers is bitwise the CPU reference's
    expand of the same partials (fp32 operands, so no rounding at the store hides a bit), and
    the u it keeps is the partials' sum."""
    t, n, chunks = 37, sum(sizes), 3
    g = torch.Generator().manual_seed(rank)
    partials = torch.randn(chunks, t, len(sizes) * rank, generator=g)
    b, base = torch.randn(n, rank, generator=g), torch.randn(t, n, generator=g)
    scalings = SCALINGS[:len(sizes)] + (0.75,) * (len(sizes) - len(SCALINGS))
    kept = torch.full((t, len(sizes) * rank), float("nan"), device=DEVICE)
    got = lora_expand_triton(base.to(DEVICE), partials.to(DEVICE), b.to(DEVICE), None, sizes, scalings,
                             torch.empty(t, n, device=DEVICE), kept)
    u = partials[0] + partials[1] + partials[2]
    want = torch.empty(t, n)
    lora_expand_reference(base, u, b, None, sizes, scalings, want)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
    assert torch.equal(kept.cpu().view(torch.int32), u.view(torch.int32))


def test_expand_keeps_signed_zeros_as_the_reference():
    """u and B columns read out of registers (a sum of one value and zeros) turn -0.0 into +0.0;
    the outputs keep the reference's bits anyway, signed zeros included: rows whose u is all
    -0.0, B columns of -0.0, bases of -0.0."""
    t, sizes, rank = 8, (40, 24), 4
    n = sum(sizes)
    g = torch.Generator().manual_seed(5)
    u = torch.randn(t, 2 * rank, generator=g)
    u[:3] = -0.0
    u[3, ::2] = -0.0
    b = torch.randn(n, rank, generator=g)
    b[::3] = -0.0
    b[:, 1] = -0.0
    base = torch.randn(t, n, generator=g)
    base[:5, :20] = -0.0
    base[:5, 40:50] = -0.0  # member 1 scales by -0.5: a zero update there is -0.0
    got = lora_expand_triton(base.to(DEVICE), u[None].to(DEVICE), b.to(DEVICE), None, sizes, (2.0, -0.5),
                             torch.empty(t, n, device=DEVICE))
    want = torch.empty(t, n)
    lora_expand_reference(base, u, b, None, sizes, (2.0, -0.5), want)
    assert (want.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any()  # the case is there
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))


def test_expand_tiles_give_the_same_bits():
    """`ExpandTile`: narrower, wider and fewer-warp launches of the expand give bitwise the default
    tile's output and kept u (the expand is element-wise), at a decode-sized and a ragged batch of
    a three-member group; a tile under 16 rows or columns is refused before any launch."""
    from vexact_models.kernels.lora_expand import ExpandTile

    sizes, rank = (96, 32, 32), 16
    for t in (5, 40):
        base, x, a, b = operands(t, 200, sizes, rank, torch.bfloat16, torch.float32, seed=t)
        partials = lora_partials_triton(x, a)
        runs = []
        for tile in (None, ExpandTile(16, 32, 4), ExpandTile(64, 64, 2), ExpandTile(32, 16, 1)):
            kept = torch.full((t, len(sizes) * rank), float("nan"), device=DEVICE)
            out = lora_expand_triton(base, partials, b, None, sizes, SCALINGS[:3], torch.empty_like(base), kept, tile)
            runs.append((out, kept))
        assert all(torch.equal(o, runs[0][0]) and torch.equal(u, runs[0][1]) for o, u in runs[1:])
    with pytest.raises(ValueError, match="block_m, block_n >= 16"):
        lora_expand_triton(base, partials, b, None, sizes, SCALINGS[:3], torch.empty_like(base), None,
                           ExpandTile(8, 32, 4))
