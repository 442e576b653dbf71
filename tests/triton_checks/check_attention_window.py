"""Sliding windows and attention sinks in the attention kernels (`kernels/attention_window.py`):
the packed forward against `attention_math`, prompt chunks and decode steps over shuffled pages
bitwise the packed rows (pointer and TMA loads, every tile), the backward (sinks' gradient
included) against autograd. Run like check_triton_kernels.py (its docstring): on CPU under the
Triton interpreter, or on a GPU with ``python -m pytest tests/triton_checks/check_attention_window.py``."""

import sys
from pathlib import Path

import pytest
import torch

# pytest's importlib mode does not put this folder on sys.path; importing the shared helpers
# also applies their skip rule (conftest.py patches the interpreter's tl.dot)
sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, INTERPRET, close, last_tokens, rand, write_pages

from vexact_models.kernels import PagedLayout, attention, attention_packed
from vexact_models.kernels.attention import AttentionConfig, attention_triton, packed_layout
from vexact_models.kernels.attention_backward import attention_math
from vexact_models.kernels.paged_layout import shuffled_block_table

LENS = [1, 20, 70, 130]  # windows shorter than most sequences, sequences ending mid-block, past two blocks


def _packed(hq, hkv, d, dtype=torch.float32):
    t = sum(LENS)
    q, k, v = (rand(t, h, d).to(dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    return q, k, v, cu


def _paged(k, v, page_size, fill=float("nan")):
    """The packed K/V in shuffled pages of `page_size` (NaN in every unwritten slot)."""
    n_pages = sum(-(-n // page_size) for n in LENS)
    table = shuffled_block_table(LENS, page_size, torch.Generator().manual_seed(page_size)).to(DEVICE)
    kc = torch.full((n_pages, page_size, *k.shape[1:]), fill, dtype=k.dtype, device=DEVICE)
    vc = torch.full((n_pages, page_size, *v.shape[1:]), fill, dtype=v.dtype, device=DEVICE)
    write_pages(k, v, kc, vc, table, LENS)
    return kc, vc, table


@pytest.mark.parametrize("window,with_sinks", [(1, False), (5, True), (64, False), (100, True), (1000, True)])
def test_packed_window_and_sinks_match_math(window, with_sinks):
    q, k, v, cu = _packed(4, 2, 64)
    sinks = rand(4) if with_sinks else None
    got = attention_packed(q, k, v, cu, max(LENS), 0.125, window=window, sinks=sinks)
    want = attention_math(q.double(), k.double(), v.double(), cu, 0.125, window,
                          None if sinks is None else sinks.double())
    close(got, want, 1e-5 if INTERPRET else 2e-3)  # GPU: fp32 products in TF32 (1.09e-3 with sinks, H200)


@pytest.mark.parametrize("window,with_sinks,chunk,page_size", [(7, False, 1, 16), (16, True, 9, 64), (64, True, 1, 64),
                                                               (90, False, 9, 16), (None, True, 1, 16), (5, True, 9, 16)])
def test_paged_chunks_and_decode_equal_packed_bitwise(window, with_sinks, chunk, page_size):
    """Each sequence's last `chunk` tokens (a decode step at 1, a prompt chunk at 9) over shuffled
    pages give bitwise the packed rows and lse, for windows shorter than the sequences and sinks."""
    q, k, v, cu = _packed(4, 2, 64, torch.bfloat16)
    sinks = rand(4) if with_sinks else None
    layout = packed_layout(cu, max(LENS))
    packed, lse = attention_triton(q, k, v, layout, 0.125, window=window, sinks=sinks)
    assert torch.equal(attention_packed(q, k, v, cu, max(LENS), 0.125, window=window, sinks=sinks), packed)
    kc, vc, table = _paged(k, v, page_size)
    idx, chunk_layout = last_tokens(LENS, chunk, table, page_size)
    out, chunk_lse = attention_triton(q[idx], kc.flatten(0, 1), vc.flatten(0, 1), chunk_layout, 0.125, window=window,
                                      sinks=sinks)
    assert not out.isnan().any()
    assert torch.equal(out, packed[idx]) and torch.equal(chunk_lse, lse[idx])
    assert torch.equal(attention(q[idx], kc, vc, chunk_layout, 0.125, window=window, sinks=sinks), packed[idx])


@pytest.mark.parametrize("window", [3, 70])
def test_every_tile_and_load_path_gives_the_same_bits(window):
    """Training tiles of 16-128 rows, TMA K/V descriptors, decode by page TMA and by pointer loads:
    one row's bits (the window's leading blocks skipped by one tile, fully masked in another)."""
    q, k, v, cu = _packed(4, 2, 64, torch.bfloat16)
    sinks = rand(4)
    layout = packed_layout(cu, max(LENS))
    first = None
    for cfg in (AttentionConfig(16, 64, 4, 3), AttentionConfig(64, 64, 4, 2), AttentionConfig(128, 64, 4, 2)):
        for tma in (False, True):
            out, lse = attention_triton(q, k, v, layout, 0.125, cfg, kv_descriptors=tma, window=window, sinks=sinks)
            first = first or (out, lse)
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), (cfg, tma)
    kc, vc, table = _paged(k, v, 64)
    idx, decode = last_tokens(LENS, 1, table, 64)
    for tma in (False, True):
        out, lse = attention_triton(q[idx], kc.flatten(0, 1), vc.flatten(0, 1), decode, 0.125,
                                    AttentionConfig(16, 64, 4, 3), page_descriptors=tma, window=window, sinks=sinks)
        assert torch.equal(out, first[0][idx]) and torch.equal(lse, first[1][idx]), tma


def test_decode_never_reads_keys_behind_the_window():
    """Pages wholly behind a decode step's window may hold anything (the engine frees them): NaN
    there changes no bit."""
    q, k, v, cu = _packed(4, 2, 64, torch.bfloat16)
    window, page_size = 20, 16
    kc, vc, table = _paged(k, v, page_size)
    idx, decode = last_tokens(LENS, 1, table, page_size)
    want = attention(q[idx], kc, vc, decode, 0.125, window=window)
    for s, n in enumerate(LENS):
        first_kept = max(0, n - window) // 64 * 64  # attention_window.window_block_start of the last query
        for page in range(first_kept // page_size):
            kc[table[s, page]] = float("nan")
            vc[table[s, page]] = float("nan")
    assert torch.equal(attention(q[idx], kc, vc, decode, 0.125, window=window), want)


@pytest.mark.parametrize("chunk", [1, 9])
def test_entries_behind_the_window_may_name_any_page(chunk):
    """The window page group's released entries (`runtime.page_groups`, docs/design.md section 6)
    name pages that are someone else's now, or page 0: a prompt chunk's or decode step's table
    entries wholly below its first query's window_block_start pointed at a page of NaN change no
    bit."""
    q, k, v, cu = _packed(4, 2, 64, torch.bfloat16)
    window, page_size = 20, 16
    kc, vc, table = _paged(k, v, page_size)
    idx, layout = last_tokens(LENS, chunk, table, page_size)
    want = attention(q[idx], kc, vc, layout, 0.125, window=window)
    nan_page = kc.shape[0]
    kc, vc = (torch.cat([c, torch.full_like(c[:1], float("nan"))]) for c in (kc, vc))
    moved = table.clone()
    for s, n in enumerate(LENS):
        first = max(0, n - min(chunk, n) - window + 1) // 64 * 64  # window_block_start of the chunk's first query
        moved[s, :first // page_size] = nan_page
    assert (moved == nan_page).any()
    layout.block_table = moved
    assert torch.equal(attention(q[idx], kc, vc, layout, 0.125, window=window), want)


@pytest.mark.parametrize("window,with_sinks,dtype", [(None, True, torch.float32), (9, False, torch.bfloat16),
                                                      (33, True, torch.float32), (33, True, torch.bfloat16)])
def test_backward_with_window_and_sinks(window, with_sinks, dtype):
    q, k, v, cu = _packed(4, 2, 64, dtype)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    sinks = (rand(4) * 2).requires_grad_() if with_sinks else None
    g = rand(sum(LENS), 4, 64).to(dtype)
    inputs = (q, k, v) + ((sinks,) if with_sinks else ())
    got = torch.autograd.grad(attention_packed(q, k, v, cu, max(LENS), 0.125, window=window, sinks=sinks), inputs, g)
    ref_inputs = tuple(x.detach().double().requires_grad_() for x in inputs)
    ref_sinks = ref_inputs[3] if with_sinks else None
    want = torch.autograd.grad(attention_math(*ref_inputs[:3], cu, 0.125, window, ref_sinks), ref_inputs, g.double())
    for a, b in zip(got, want):
        close(a, b, (1e-4 if INTERPRET else 5e-3) if dtype == torch.float32 else 2e-2)  # GPU fp32: TF32 products


def test_window_and_sinks_argument_errors():
    q, k, v, cu = _packed(4, 2, 64)
    layout = PagedLayout(cu, cu[1:] - cu[:-1], torch.zeros(4, 1, dtype=torch.int32, device=DEVICE), 1, max(LENS))
    with pytest.raises(ValueError, match="window=0"):
        attention_packed(q, k, v, cu, max(LENS), window=0)
    with pytest.raises(ValueError, match="3 logits.*4 query heads"):
        attention(q, k, v, layout, window=4, sinks=rand(3))
