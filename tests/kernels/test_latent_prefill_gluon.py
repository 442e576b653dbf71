"""The Gluon latent MLA prefill/training kernel (`kernels.latent_prefill_gluon`): where it takes a
launch (CPU), and on a Hopper GPU the Triton launch's bits for chunked prefill over shuffled pages
and for packed training, whichever rows, warps and stages a program runs."""

import dataclasses

import pytest
import torch

from vexact_models.kernels import attention_packed, gluon_support, latent_prefill_gluon
from vexact_models.kernels.attention import packed_layout
from vexact_models.kernels.latent_attention import latent_attention_triton, pick_config
from vexact_models.kernels.paged_layout import shuffled_block_table

from ..conftest import compiled_variants, paged_cache, paged_layout

LAT, ROPE, HEADS = 512, 64, 16


def test_shape_fits_prefill_of_moonlights_shape_over_whole_block_pages_or_packed_rows():
    q = torch.zeros(10, HEADS, LAT + ROPE, dtype=torch.bfloat16)
    kv = torch.zeros(128, 1, LAT + ROPE, dtype=torch.bfloat16)
    paged = paged_layout([6, 4], [70, 4], torch.zeros(2, 2, dtype=torch.int32), 64)
    assert latent_prefill_gluon.shape_fits(q, kv, LAT, paged)
    assert not latent_prefill_gluon.shape_fits(q, kv, LAT, dataclasses.replace(paged, page_size=16))
    assert not latent_prefill_gluon.shape_fits(q, kv, LAT, dataclasses.replace(paged, max_seqlen_q=1))  # decode
    assert not latent_prefill_gluon.shape_fits(q.float(), kv.float(), LAT, paged)
    assert not latent_prefill_gluon.shape_fits(q[:, :8], kv, LAT, paged)  # 8 heads: not a count it takes
    assert latent_prefill_gluon.shape_fits(torch.zeros(10, 128, LAT + ROPE, dtype=torch.bfloat16), kv, LAT, paged)
    assert not latent_prefill_gluon.shape_fits(q[..., :320], kv[..., :320], 256, paged)
    packed = packed_layout(torch.tensor([0, 6, 10], dtype=torch.int32), 6)
    assert latent_prefill_gluon.shape_fits(q, kv[:10], LAT, packed, contiguous=True)
    assert not latent_prefill_gluon.shape_fits(q, kv[:10], LAT, packed)  # pages of 1 slot: not contiguous rows
    assert not latent_prefill_gluon.fits(q, kv, LAT, paged)  # CPU tensors
    with pytest.raises(ValueError, match="latent_prefill_gluon: this launch does not fit the kernel"):
        latent_prefill_gluon.latent_prefill_gluon(q, kv, LAT, paged, 0.1)


def test_prefill_switch_defaults_to_gluon_and_names_a_bad_value(monkeypatch):
    assert latent_prefill_gluon.LATENT_PREFILL.default == "gluon"
    monkeypatch.setenv("VEXACT_LATENT_PREFILL", "cuda")
    with pytest.raises(ValueError, match="VEXACT_LATENT_PREFILL='cuda'.*'gluon', 'triton'"):
        latent_prefill_gluon.LATENT_PREFILL.mode()


needs_gluon = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
                                      and gluon_support.HAS_GLUON),
                                 reason="the Gluon kernel needs a Hopper GPU and a verified Triton")
CANDIDATES = ((32, 4, 2), (32, 8, 2), (64, 8, 1))  # (rows, warps, stages): every one must give the same bits


def _gluon_calls(monkeypatch) -> list:
    calls, run = [], latent_prefill_gluon.latent_prefill_gluon
    monkeypatch.setattr(latent_prefill_gluon, "latent_prefill_gluon", lambda *a, **k: calls.append(a) or run(*a, **k))
    return calls


@needs_gluon
@pytest.mark.parametrize("heads", [16, 128])  # Moonlight (4 tokens a tile), DeepSeek-V3 (half a token)
def test_chunked_prefill_equals_the_triton_launch_and_training_bitwise(heads, monkeypatch):
    """Two prefill chunks a sequence over shuffled pages of 64 (NaN in every unwritten slot): the
    second attends to the first as context. Lengths cover partial tiles (tokens not a multiple of
    4), partial key blocks and a sequence of one token beside long ones; the Gluon launch, every
    candidate, longest-first order, the Triton launch and the packed training forward agree."""
    gen = torch.Generator().manual_seed(heads)
    lens, page = [1, 3, 63, 64, 65, 200, 517, 1100], 64
    t = sum(lens)
    q = torch.randn(t, heads, LAT + ROPE, generator=gen).bfloat16().cuda()
    k = torch.randn(t, 1, LAT + ROPE, generator=gen).bfloat16().cuda()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    with latent_prefill_gluon.LATENT_PREFILL.use("triton"):
        trained = attention_packed(q, k, k[..., :LAT], cu.cuda(), max(lens))
    table = shuffled_block_table(lens, page, gen)
    cache = paged_cache(k, lens, table, page).cuda()
    scale = (LAT + ROPE) ** -0.5
    calls = _gluon_calls(monkeypatch)
    for first in ([0] * len(lens), [n // 3 for n in lens]):  # one chunk; then after a first third as context
        second = [n - f for n, f in zip(lens, first)]
        rows = torch.cat([torch.arange(c + f, c + n) for c, f, n in zip(cu[:-1].tolist(), first, lens)]).cuda()
        layout = paged_layout(second, lens, table, page, "cuda")
        triton_cfg = pick_config(q.dtype, layout.max_seqlen_q * heads, len(lens), 132)
        want, want_lse = latent_attention_triton(q[rows], cache, LAT, layout, scale, triton_cfg)
        assert torch.equal(want, trained[rows]) and not want.isnan().any()
        out, lse = latent_attention_triton(q[rows], cache, LAT, layout, scale)  # the default: Gluon
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        ordered = dataclasses.replace(layout, seq_order=torch.tensor(lens).argsort(descending=True).int().cuda())
        flat = cache.reshape(-1, 1, LAT + ROPE)
        for cand in CANDIDATES:
            for lay in (layout, ordered):
                out = torch.empty_like(want)
                lse = torch.empty_like(want_lse)
                latent_prefill_gluon.launch(q[rows], flat, LAT, lay, scale, out, lse, *cand)
                assert torch.equal(out, want) and torch.equal(lse, want_lse), cand
    assert len(calls) == 2  # the default launch went to the Gluon kernel, once a chunk
    with latent_prefill_gluon.LATENT_PREFILL.use("triton"):
        out, lse = latent_attention_triton(q[rows], cache, LAT, layout, scale)
    assert len(calls) == 2 and torch.equal(out, want)


@needs_gluon
@pytest.mark.parametrize("lens", [[4096, 4096], [7, 1024, 2000, 33]])
def test_packed_training_forward_takes_the_gluon_kernel_with_the_triton_bits(lens, monkeypatch):
    """The training forward (`attention_packed`, keys in consecutive rows) runs the Gluon kernel
    by default and gives the Triton launch's output; gradients come from the same out/lse."""
    gen = torch.Generator().manual_seed(len(lens))
    t = sum(lens)
    q = torch.randn(t, HEADS, LAT + ROPE, generator=gen).bfloat16().cuda()
    k = torch.randn(t, 1, LAT + ROPE, generator=gen).bfloat16().cuda()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).cuda()
    with latent_prefill_gluon.LATENT_PREFILL.use("triton"):
        want = attention_packed(q, k, k[..., :LAT], cu, max(lens))
    calls = _gluon_calls(monkeypatch)
    got = attention_packed(q, k, k[..., :LAT], cu, max(lens))
    assert len(calls) == 1 and torch.equal(got, want)


@needs_gluon
def test_one_compile_serves_every_batch_shape():
    """The sequence count, the longest sequence and the block table's width change from training
    batch to training batch; none of them compiles the kernel again (runtime arguments)."""
    gen = torch.Generator().manual_seed(3)
    kernel, seen = latent_prefill_gluon._latent_prefill_kernel, None
    for lens in ([100], [65, 300, 17], [64] * 16, [1000, 33]):
        t = sum(lens)
        q = torch.randn(t, HEADS, LAT + ROPE, generator=gen).bfloat16().cuda()
        k = torch.randn(t, 1, LAT + ROPE, generator=gen).bfloat16().cuda()
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).cuda()
        latent_prefill_gluon.latent_prefill_gluon(q, k, LAT, packed_layout(cu, max(lens)), 0.1, contiguous=True)
        seen = compiled_variants(kernel) if seen is None else seen
    assert compiled_variants(kernel) == seen
