"""Latent MLA attention (the value is a view of the key's first dims) on the reference backend:
the view is recognised, packed == chunked prefill == decode over a latent paged cache (bitwise),
values and gradients against float64 autograd. The Triton kernel's logic is checked in
tests/triton_checks/check_latent_attention.py, its invariance on the GPU by kernel_invariance.py."""

import dataclasses

import pytest
import torch

from vexact_models.kernels import PagedLayout, attention, attention_packed, kv_cache_write, latent_decode_gluon
from vexact_models.kernels.attention_backward import attention_math
from vexact_models.kernels.latent_attention import (LatentConfig, latent_attention_triton, page_descriptors_fit,
                                                    value_in_key)
from vexact_models.kernels.paged_layout import shuffled_block_table, slots_reference

from ..conftest import paged_cache, rel_err

LAT, ROPE = 16, 8


def _latent(lens, heads=4, dtype=torch.float32):
    t = sum(lens)
    q = torch.randn(t, heads, LAT + ROPE).to(dtype)
    k = torch.randn(t, 1, LAT + ROPE).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return q, k, cu


def test_value_in_key_recognises_only_a_leading_view():
    k = torch.randn(5, 1, 24)
    assert value_in_key(k, k[..., :16])
    assert not value_in_key(k, k[..., 8:])  # not the leading dims
    assert not value_in_key(k, k[..., :16].clone())  # a copy
    assert not value_in_key(k, k)  # the whole key is not a value view
    cache = torch.randn(3, 4, 1, 24)
    assert value_in_key(cache, cache[..., :16])


def _run_paged(q, k, lens, chunk, page_size=4):
    """Chunks of `chunk` tokens per sequence and step over a shuffled latent paged cache (NaN
    outside the written slots, V a view of K)."""
    pages = [-(-n // page_size) for n in lens]
    table = shuffled_block_table(lens, page_size, torch.Generator().manual_seed(0))
    k_cache = torch.full((sum(pages), page_size, 1, LAT + ROPE), float("nan"), dtype=q.dtype)
    v_cache = k_cache[..., :LAT]
    starts = [0] + list(torch.tensor(lens).cumsum(0).tolist())
    out, done = q.new_empty(q.shape[0], q.shape[1], LAT), [0] * len(lens)
    while any(d < n for d, n in zip(done, lens)):
        rows = [s for s in range(len(lens)) if done[s] < lens[s]]
        sel, cu, seq_lens, slots = [], [0], [], []
        for s in rows:
            n = min(chunk, lens[s] - done[s])
            sel += range(starts[s] + done[s], starts[s] + done[s] + n)
            slots += slots_reference(table, s, torch.arange(done[s], done[s] + n), page_size).tolist()
            cu.append(cu[-1] + n)
            done[s] += n
            seq_lens.append(done[s])
        idx = torch.tensor(sel)
        kv_cache_write(k[idx], k[idx][..., :LAT], k_cache, v_cache, torch.tensor(slots))
        layout = PagedLayout(torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             table[rows].contiguous(), page_size, max(b - a for a, b in zip(cu, cu[1:])))
        out[idx] = attention(q[idx], k_cache, v_cache, layout, 0.3)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_packed_equals_chunked_prefill_and_decode_bitwise(dtype):
    lens = [1, 6, 19, 33]
    q, k, cu = _latent(lens, dtype=dtype)
    packed = attention_packed(q, k, k[..., :LAT], cu, max(lens), 0.3)
    want = attention_math(q.double(), k.double(), k.double()[..., :LAT], cu, 0.3)
    assert packed.shape == (q.shape[0], 4, LAT)
    assert rel_err(packed, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    for chunk in (1, 5, 64):
        assert torch.equal(_run_paged(q, k, lens, chunk), packed), f"chunk={chunk}"


def test_latent_backward_matches_float64_autograd():
    """Gradients reach the key through both its uses (the scores and, via the view, the value)."""
    lens = [3, 11, 14]
    q, k, cu = _latent(lens, dtype=torch.float64)
    q.requires_grad_(), k.requires_grad_()
    g = torch.randn(q.shape[0], 4, LAT, dtype=torch.float64)
    got = torch.autograd.grad(attention_packed(q, k, k[..., :LAT], cu, 14), (q, k), g)
    qd, kd = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    want = torch.autograd.grad(attention_math(qd, kd, kd[..., :LAT], cu, (LAT + ROPE) ** -0.5), (qd, kd), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)
    assert want[1][..., :LAT].abs().sum() > 0 and want[1][..., LAT:].abs().sum() > 0


def test_page_descriptors_fit_only_hopper_decode_over_whole_block_pages():
    """TMA needs a Hopper GPU: never on CPU; the other conditions hold here, so only the device says no."""
    k = torch.zeros(8, 64, 1, 576, dtype=torch.bfloat16).reshape(-1, 1, 576)
    assert not page_descriptors_fit(k, 64, 512, 16)
    layout = PagedLayout(torch.arange(3, dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32),
                         torch.zeros(2, 1, dtype=torch.int32), 64, 1)
    assert not latent_decode_gluon.fits(torch.zeros(2, 16, 576, dtype=torch.bfloat16), k, 512, layout)
    with pytest.raises(ValueError, match="does not fit the kernel"):
        latent_decode_gluon.latent_decode_gluon(torch.zeros(2, 16, 576, dtype=torch.bfloat16), k, 512, layout, 0.1)
    with pytest.raises(ValueError, match="value_chunks=3 must be 1, 2, 4 or 8"):
        latent_decode_gluon.latent_decode_gluon(torch.zeros(2, 16, 576, dtype=torch.bfloat16), k, 512, layout, 0.1, 3)


def test_gluon_decode_takes_value_chunks_only_for_a_rollouts_last_few_sequences():
    assert [latent_decode_gluon.value_chunks(n, 132) for n in (1, 33, 34, 66, 67, 256)] == [4, 4, 2, 2, 1, 1]
    assert latent_decode_gluon.LATENT_DECODE.default == "gluon"


needs_tma = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                               reason="TMA loads need a Hopper or newer GPU")


@needs_tma
@pytest.mark.parametrize("heads", [16, 128])  # Moonlight, DeepSeek-V3
def test_decode_by_tma_equals_pointer_loads_and_training_bitwise(heads, monkeypatch):
    """Decode over shuffled pages of 64 (NaN in every unwritten slot): whole key blocks by TMA,
    the same launch by pointer loads, and the packed training forward agree bitwise; pages of 16,
    fp32 caches and prefill-sized launches keep the pointer loads."""
    lat, rope, page = 512, 64, 64
    lens = [1, 63, 64, 65, 200, 517]
    gen = torch.Generator().manual_seed(heads)
    t = sum(lens)
    q = torch.randn(t, heads, lat + rope, generator=gen).bfloat16().cuda()
    k = torch.randn(t, 1, lat + rope, generator=gen).bfloat16().cuda()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    packed = attention_packed(q, k, k[..., :lat], cu.cuda(), max(lens))
    table = shuffled_block_table(lens, page, gen)
    cache = paged_cache(k, lens, table, page).cuda()
    layout = PagedLayout(torch.arange(len(lens) + 1, dtype=torch.int32).cuda(), torch.tensor(lens, dtype=torch.int32).cuda(),
                         table.cuda(), page, 1)
    last = (cu[1:] - 1).long().cuda()
    assert page_descriptors_fit(cache, page, lat, heads)
    assert not page_descriptors_fit(cache, 16, lat, heads) and not page_descriptors_fit(cache.float(), page, lat, heads)
    assert not page_descriptors_fit(cache, page, lat, 129)
    scale = (lat + rope) ** -0.5
    by_tma, lse_tma = latent_attention_triton(q[last], cache, lat, layout, scale, kv_descriptors=True)
    by_ptr, lse_ptr = latent_attention_triton(q[last], cache, lat, layout, scale, kv_descriptors=False)
    assert torch.equal(by_tma, by_ptr) and torch.equal(lse_tma, lse_ptr)
    assert torch.equal(by_tma, packed[last])
    assert not by_tma.isnan().any()
    # value chunks (each program one slice of the value dims, read by its own TMA copy): the same bits
    for chunks, warps, stages in ((2, 8, 2), (4, 8, 3), (4, 4, 3)):
        cfg = LatentConfig(16, 64, warps, stages, chunks)
        out, lse = latent_attention_triton(q[last], cache, lat, layout, scale, cfg, kv_descriptors=True)
        assert torch.equal(out, by_tma) and torch.equal(lse, lse_tma), cfg
    # programs taking the sequences longest first (the engine's PagedLayout.seq_order): the same bits
    ordered = dataclasses.replace(layout, seq_order=torch.tensor(lens).argsort(descending=True).int().cuda())
    for tma in (True, False):
        out, lse = latent_attention_triton(q[last], cache, lat, ordered, scale, kv_descriptors=tma)
        assert torch.equal(out, by_tma) and torch.equal(lse, lse_tma), tma
    # the Gluon launch (warpgroup MMAs, key-major; Moonlight's 16 heads): the same bits
    fits = latent_decode_gluon.fits(q[last], cache.reshape(-1, 1, lat + rope), lat, layout)
    assert fits == (heads == latent_decode_gluon.HEADS and latent_decode_gluon.HAS_GLUON)
    if fits:
        for lay, chunks in ((layout, 1), (ordered, 1), (layout, 2), (ordered, 4), (layout, 8)):
            out, lse = latent_decode_gluon.latent_decode_gluon(q[last], cache.reshape(-1, 1, lat + rope), lat, lay,
                                                               scale, chunks)
            assert torch.equal(out, by_tma) and torch.equal(lse, lse_tma), chunks
    calls, gluon = [], latent_decode_gluon.latent_decode_gluon
    monkeypatch.setattr(latent_decode_gluon, "latent_decode_gluon", lambda *a: calls.append(a[-1]) or gluon(*a))
    for mode in ("gluon", "triton"):  # the default routes a launch that fits to the Gluon kernel
        with latent_decode_gluon.LATENT_DECODE.use(mode):
            out, lse = latent_attention_triton(q[last], cache, lat, layout, scale)
        assert torch.equal(out, by_tma) and torch.equal(lse, lse_tma), mode
    assert calls == ([latent_decode_gluon.value_chunks(len(lens), torch.cuda.get_device_properties(0).multi_processor_count)]
                     if fits else [])  # the Gluon launch ran once, under "gluon", with the value chunks it picks
    with pytest.raises(ValueError, match="kv_descriptors=True needs pages of a multiple of block_n=64"):
        latent_attention_triton(q[last], cache, lat, PagedLayout(layout.cu_seqlens_q, layout.seq_lens, table.cuda(), 32, 1),
                                scale, kv_descriptors=True)
