"""The attention kernels (`kernels/attention.py`) vs the CPU reference, on small shapes: packed,
paged (pages of any size, 32- and 64-bit offsets), TMA and pointer loads, decode tiles, and the
backward. Run like check_triton_kernels.py (its docstring): on CPU under the Triton interpreter,
or on a GPU with ``python -m pytest tests/triton_checks/check_attention.py``."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

# pytest's importlib mode does not put this folder on sys.path; importing the shared helpers
# also applies their skip rule (conftest.py patches the interpreter's tl.dot)
sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, INTERPRET, close, last_tokens, rand, write_pages

from vexact_models.kernels import PagedLayout, attention, attention_packed
from vexact_models.kernels.attention_backward import attention_math
from vexact_models.kernels.paged_layout import shuffled_block_table, slots_reference


@pytest.mark.parametrize("hq,hkv,d,dv", [(4, 2, 64, 64), (2, 2, 128, 128), (8, 1, 64, 64), (3, 3, 192, 128),
                                         (2, 1, 256, 256)])
def test_attention_packed_and_paged(hq, hkv, d, dv):
    lens = [1, 20, 70]
    t = sum(lens)
    q, k, v = rand(t, hq, d), rand(t, hkv, d), rand(t, hkv, dv)
    cu = torch.tensor([0, 1, 21, 91], dtype=torch.int32, device=DEVICE)
    packed = attention_packed(q, k, v, cu, 70)
    close(packed, attention_math(q.double(), k.double(), v.double(), cu, d ** -0.5), 1e-5 if INTERPRET else 1e-3)
    # last 5 tokens of each sequence as a chunk over a paged cache (page 16, shuffled pages)
    page_size, pages = 16, [[3], [0, 5], [1, 6, 2, 7, 4]]
    table = torch.tensor([p + [0] * (5 - len(p)) for p in pages], dtype=torch.int32, device=DEVICE)
    kc, vc = torch.zeros(8, page_size, hkv, d, device=DEVICE), torch.zeros(8, page_size, hkv, dv, device=DEVICE)
    write_pages(k, v, kc, vc, table, lens)
    idx, layout = last_tokens(lens, 5, table, page_size)
    paged = attention(q[idx], kc, vc, layout)
    assert torch.equal(paged, packed[idx])  # one kernel, other tiles: bitwise (rule 2)


@pytest.mark.parametrize("page_size", [16, 24, 64])
@pytest.mark.parametrize("offsets_32", [True, False])
def test_attention_over_pages_of_any_size_equals_packed(page_size, offsets_32, monkeypatch):
    """Chunks over shuffled pages of a power-of-two size (a key's page and offset by shift and
    mask, `page_shift`) and of 24 slots (by division), addressed in 32 or (as for caches past
    2**31 elements, `offsets_fit_int32`) 64 bits, give bitwise the packed forward's rows."""
    import importlib

    attention_module = importlib.import_module("vexact_models.kernels.attention")  # the package's `attention` is the op
    hq, hkv, d = 4, 2, 64
    lens = [1, 20, 70]
    cu = torch.tensor([0, 1, 21, 91], dtype=torch.int32, device=DEVICE)
    q, k, v = rand(91, hq, d), rand(91, hkv, d), rand(91, hkv, d)
    packed = attention_packed(q, k, v, cu, 70)
    n_pages = sum(-(-n // page_size) for n in lens)
    table = shuffled_block_table(lens, page_size, torch.Generator().manual_seed(page_size)).to(DEVICE)
    kc = torch.full((n_pages, page_size, hkv, d), float("nan"), device=DEVICE)
    vc = torch.full((n_pages, page_size, hkv, d), float("nan"), device=DEVICE)
    write_pages(k, v, kc, vc, table, lens)
    idx, layout = last_tokens(lens, 7, table, page_size)  # each sequence's last 7 tokens, after the rest as context
    monkeypatch.setattr(attention_module, "offsets_fit_int32", lambda *tensors: offsets_32)
    assert torch.equal(attention(q[idx], kc, vc, layout), packed[idx]), page_size


@pytest.mark.parametrize("hq,hkv,d,dtype", [(4, 2, 64, torch.float32), (2, 2, 128, torch.bfloat16), (8, 1, 64, torch.bfloat16)])
def test_attention_kv_descriptors_match_pointer_loads(hq, hkv, d, dtype):
    """The packed training forward with whole key blocks through TMA descriptors gives bitwise
    the pointer loads' output and lse, for every tile, on sequences that end mid-block. K and V
    are views of one fused projection (as a model's qkv split leaves them)."""
    from vexact_models.kernels.attention import AttentionConfig, attention_triton, packed_layout

    lens = [1, 64, 130, 70]
    t = sum(lens)
    kv = rand(t, 2 * hkv * d).to(dtype)
    k, v = kv[:, :hkv * d].view(t, hkv, d), kv[:, hkv * d:].view(t, hkv, d)
    q = rand(t, hq, d).to(dtype)
    layout = packed_layout(torch.tensor([0, 1, 65, 195, 265], dtype=torch.int32, device=DEVICE), max(lens))
    for cfg in (AttentionConfig(64, 64, 4, 2), AttentionConfig(128, 64, 4, 2), AttentionConfig(16, 64, 4, 3)):
        out, lse = attention_triton(q, k, v, layout, d ** -0.5, cfg)
        out_tma, lse_tma = attention_triton(q, k, v, layout, d ** -0.5, cfg, kv_descriptors=True)
        assert torch.equal(out_tma, out) and torch.equal(lse_tma, lse), cfg


@pytest.mark.parametrize("hq,hkv,q_len", [(16, 8, 1), (32, 8, 1), (8, 2, 2)])
def test_attention_decode_load_paths_match(hq, hkv, q_len):
    """Decode launches over shuffled pages of 64 (NaN in every unwritten slot) give bitwise the
    same output and lse whether whole key blocks come by TMA page by page or by pointer loads,
    whatever the stages and the program order;
    sequences end before, at and after a block's end (`q_len` > 1: a short chunk, whose rows mask
    within a block)."""
    from vexact_models.kernels.attention import AttentionConfig, attention_reference, attention_triton

    d, page = 128, 64
    lens = [1, 63, 64, 65, 130, 200]
    gen = torch.Generator().manual_seed(hq + q_len)
    table = shuffled_block_table(lens, page, gen)
    caches = [torch.full((sum(-(-n // page) for n in lens) * page, hkv, d), float("nan"), dtype=torch.bfloat16)
              for _ in range(2)]
    for s, n in enumerate(lens):
        slots = slots_reference(table, s, torch.arange(n), page)
        for cache in caches:
            cache[slots] = torch.randn(n, hkv, d, generator=gen).bfloat16()
    k, v = (c.to(DEVICE) for c in caches)
    q_lens = [min(q_len, n) for n in lens]
    q = torch.randn(sum(q_lens), hq, d, generator=gen).bfloat16().to(DEVICE)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    layout = PagedLayout(cu.to(DEVICE), torch.tensor(lens, dtype=torch.int32).to(DEVICE), table.to(DEVICE), page, q_len)
    first = None
    for cfg in (AttentionConfig(16, 64, 4, 3), AttentionConfig(16, 64, 4, 5), AttentionConfig(16, 64, 4, 3, True)):
        out, lse = attention_triton(q, k, v, layout, d ** -0.5, cfg, page_descriptors=False)
        by_tma, lse_tma = attention_triton(q, k, v, layout, d ** -0.5, cfg, page_descriptors=True)
        assert not out.isnan().any() and torch.equal(by_tma, out) and torch.equal(lse_tma, lse), cfg
        first = first or (out, lse)  # the program order (heads_fastest) moves no bit either
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), cfg
    # nor does the order programs take the sequences (PagedLayout.seq_order, the engine's longest first)
    for order in ([5, 4, 3, 2, 1, 0], [2, 0, 5, 1, 4, 3]):
        ordered = dataclasses.replace(layout, seq_order=torch.tensor(order, dtype=torch.int32, device=DEVICE))
        for tma in (False, True):
            out, lse = attention_triton(q, k, v, ordered, d ** -0.5, AttentionConfig(16, 64, 4, 3), page_descriptors=tma)
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), (order, tma)
    if INTERPRET:  # (on the GPU, tests/kernels/test_attention.py compares with the training forward bitwise)
        ref = attention_reference(q.float(), k.float().nan_to_num(), v.float().nan_to_num(), layout, d ** -0.5)
        close(out.float(), ref, 2e-2)


@pytest.mark.parametrize("d,dv,dtype", [(64, 64, torch.bfloat16), (192, 128, torch.bfloat16), (192, 128, torch.float32),
                                        (256, 256, torch.bfloat16)])
def test_attention_backward(d, dv, dtype):
    lens = [3, 40, 90]
    t = sum(lens)
    q, k, v = (rand(t, h, width).to(dtype).requires_grad_() for h, width in ((4, d), (2, d), (2, dv)))
    cu = torch.tensor([0, 3, 43, 133], dtype=torch.int32, device=DEVICE)
    g = rand(t, 4, dv).to(dtype)
    got = torch.autograd.grad(attention_packed(q, k, v, cu, 90, 0.125), (q, k, v), g)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attention_math(qd, kd, vd, cu, 0.125), (qd, kd, vd), g.double())
    for a, b in zip(got, want):
        close(a, b, 2e-2)
