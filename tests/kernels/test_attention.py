import dataclasses

import pytest
import torch

from vexact_models.kernels import PagedLayout, attention, attention_packed, kv_cache_write, packed_layout
from vexact_models.kernels.attention_backward import attention_math
from vexact_models.kernels.paged_layout import shuffled_block_table, slots_reference

from ..conftest import paged_cache, rel_err


def _packed(lens, hq=4, hkv=2, d=16, dtype=torch.float32, dv=None):
    """Random packed q/k ([T, H, d]) and v ([T, Hkv, dv]; dv = d unless given, as in MLA)."""
    t = sum(lens)
    q, k = (torch.randn(t, h, d).to(dtype) for h in (hq, hkv))
    v = torch.randn(t, hkv, dv or d).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("dv", [16, 8], ids=["dv=d", "dv<d"])
def test_packed_attention_matches_float64(dtype, groups, dv):
    q, k, v, cu = _packed([5, 17, 1, 40], *groups, dtype=dtype, dv=dv)
    out = attention_packed(q, k, v, cu, 40, 0.3)
    ref = attention_math(q.double(), k.double(), v.double(), cu, 0.3)
    assert out.dtype == dtype and out.shape == (q.shape[0], q.shape[1], dv)
    assert rel_err(out, ref) < {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]


@pytest.mark.parametrize("dv", [8, 4])
def test_attention_backward_matches_autograd(dv):
    q, k, v, cu = _packed([3, 9, 12], 4, 2, 8, dtype=torch.float64, dv=dv)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    g = torch.randn(q.shape[0], q.shape[1], dv, dtype=q.dtype)
    got = torch.autograd.grad(attention_packed(q, k, v, cu, 12), (q, k, v), g)
    want = torch.autograd.grad(attention_math(q, k, v, cu, 8 ** -0.5), (q, k, v), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)


def _paged_cache(n_pages, page_size, hkv, d, dv, dtype):
    # NaN-filled: any read of an unwritten slot would poison the output
    return (torch.full((n_pages, page_size, hkv, width), float("nan"), dtype=dtype) for width in (d, dv))


def _run_paged(q, k, v, lens, chunk, page_size=4, decode_after=None, **options):
    """Feed each sequence's tokens through the paged path in chunks of `chunk` tokens (decode
    when chunk == 1), with a shuffled block table; return the outputs in packed order.
    `options`: `attention`'s `window` and `sinks`."""
    hkv, d = k.shape[1], k.shape[2]
    pages_per_seq = [-(-n // page_size) for n in lens]
    table = shuffled_block_table(lens, page_size, torch.Generator().manual_seed(0))
    k_cache, v_cache = _paged_cache(sum(pages_per_seq), page_size, hkv, d, v.shape[2], q.dtype)
    starts = [0] + list(torch.tensor(lens).cumsum(0).tolist())
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    done = [0] * len(lens)
    while any(done[s] < lens[s] for s in range(len(lens))):
        # one step: every unfinished sequence contributes its next chunk (mixed batch)
        sel, cu, seq_lens, slots = [], [0], [], []
        for s in range(len(lens)):
            if done[s] >= lens[s]:
                continue
            n = min(chunk, lens[s] - done[s])
            idx = list(range(starts[s] + done[s], starts[s] + done[s] + n))
            sel += idx
            cu.append(cu[-1] + n)
            seq_lens.append(done[s] + n)
            slots += slots_reference(table, s, torch.arange(done[s], done[s] + n), page_size).tolist()
            done[s] += n
        idx = torch.tensor(sel)
        kv_cache_write(k[idx], v[idx], k_cache, v_cache, torch.tensor(slots))
        rows = [s for s in range(len(lens)) if any(starts[s] <= i < starts[s + 1] for i in sel)]
        layout = PagedLayout(torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             table[rows].contiguous(), page_size, max(b - a for a, b in zip(cu, cu[1:])))
        out[idx] = attention(q[idx], k_cache, v_cache, layout, **options)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,dv", [(16, 16), (24, 16)], ids=["gqa", "mla-dims"])
def test_attention_identical_packed_chunked_and_decode(dtype, d, dv):
    lens = [1, 7, 23, 40]
    q, k, v, cu = _packed(lens, 4, 2, d, dtype=dtype, dv=dv)
    packed = attention_packed(q, k, v, cu, max(lens))
    for chunk in (1, 3, 16):
        assert torch.equal(_run_paged(q, k, v, lens, chunk), packed), f"chunk={chunk}"
    # each sequence alone, packed, equals the batch
    for s in range(len(lens)):
        sl = slice(int(cu[s]), int(cu[s + 1]))
        alone = attention_packed(q[sl], k[sl], v[sl], torch.tensor([0, lens[s]], dtype=torch.int32), lens[s])
        assert torch.equal(alone, packed[sl])


def test_attention_page_size_does_not_matter():
    lens = [9, 30]
    q, k, v, cu = _packed(lens)
    ref = _run_paged(q, k, v, lens, 5, page_size=1)
    for ps in (2, 8, 64):
        assert torch.equal(_run_paged(q, k, v, lens, 5, page_size=ps), ref)


def test_attention_errors():
    q = torch.randn(4, 3, 16)
    k = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 KV heads"):
        attention_packed(q, k, k, torch.tensor([0, 4], dtype=torch.int32), 4)
    layout = packed_layout(torch.tensor([0, 1, 4], dtype=torch.int32), 3)
    for bad in (torch.tensor([1, 0]), torch.tensor([0], dtype=torch.int32)):  # int64; one of two sequences
        with pytest.raises(ValueError, match=r"layout.seq_order must be int32 \(2,\) on cpu like seq_lens, got "):
            attention(q[:, :2], k, k, dataclasses.replace(layout, seq_order=bad))


def test_kv_cache_write_scatters_and_skips():
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 8)
    kc, vc = torch.zeros(2, 4, 2, 4), torch.zeros(2, 4, 2, 8)
    kv_cache_write(k, v, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc.view(-1, 2, 4)[5], k[0]) and torch.equal(vc.view(-1, 2, 8)[0], v[2])
    assert kc.view(-1, 2, 4)[[1, 2, 3, 4, 6, 7]].abs().sum() == 0
    with pytest.raises(ValueError, match="dtypes"):
        kv_cache_write(k.double(), v, kc, vc, torch.tensor([0, 1, 2]))


def test_kv_descriptors_fit_layouts(monkeypatch):
    """TMA loads need a Hopper GPU (never on CPU) and K/V whose heads lie side by side in rows
    with 16-byte aligned starts and strides and power-of-two head dims (no padded lanes). A model's
    fused projection split into K and V views fits; MLA's 192-wide keys do not. (The interpreter
    check tests/triton_checks/check_attention.py compares the TMA path's bits with the
    pointer loads'.)"""
    import importlib

    module = importlib.import_module("vexact_models.kernels.attention")
    _, k, v, _ = _packed([4, 8], 4, 2, 64, dtype=torch.bfloat16)
    assert not module.kv_descriptors_fit(k, v)  # CPU tensors
    monkeypatch.setattr(module, "has_tma", lambda device: True)
    assert module.kv_descriptors_fit(k, v)
    kv = torch.randn(12, 2 * 2 * 128).bfloat16()  # [T, (K | V) heads x 128], split into views
    assert module.kv_descriptors_fit(kv[:, :256].view(12, 2, 128), kv[:, 256:].view(12, 2, 128))
    _, k192, v128, _ = _packed([4, 8], 4, 2, 192, dtype=torch.bfloat16, dv=128)
    assert not module.kv_descriptors_fit(k192, v128)  # padded head dim
    assert not module.kv_descriptors_fit(k.transpose(0, 1).contiguous().transpose(0, 1), v)  # heads not in rows
    odd = torch.randn(12 * 2 * 64 + 1).bfloat16()[1:].view(12, 2, 64)  # base 2 bytes off alignment
    assert not module.kv_descriptors_fit(odd, v)


def test_kv_descriptors_need_the_packed_layout():
    """TMA loads read sequence s's keys at its query rows: a paged cache is refused up front."""
    from vexact_models.kernels.attention import attention_triton

    q, k, v, _ = _packed([4], 2, 2, 64, dtype=torch.bfloat16)
    layout = PagedLayout(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                         torch.zeros(1, 1, dtype=torch.int32), 16, 4)
    with pytest.raises(ValueError, match="kv_descriptors=True needs packed K/V.*page_size=16"):
        attention_triton(q, k, v, layout, 0.1, kv_descriptors=True)


def test_decode_tiles_keep_one_masked_loop_and_larger_tiles_split_it():
    from vexact_models.kernels.attention import pick_config, split_mask

    assert not split_mask(pick_config(128, 8, torch.bfloat16))  # a decode step of a GQA group
    assert split_mask(pick_config(128, 64, torch.bfloat16)) and split_mask(pick_config(128, 4096, torch.bfloat16))


def test_decode_programs_run_a_sequences_kv_heads_side_by_side():
    """Decode tiles order programs heads first (neighbouring bytes of each cache row); prefill and
    training tiles keep one KV head's sequences together."""
    from vexact_models.kernels.attention import pick_config

    assert pick_config(128, 8, torch.bfloat16, 128 * 8, 132, True).heads_fastest
    assert pick_config(128, 4, torch.bfloat16, 32 * 8, 132, True, True).heads_fastest
    assert not pick_config(128, 64, torch.bfloat16).heads_fastest
    assert not pick_config(128, 4096, torch.bfloat16).heads_fastest
    assert not pick_config(192, 16, torch.bfloat16).heads_fastest  # MLA's expanded decode: not measured


def test_decode_launches_of_few_programs_take_a_deeper_pipeline_where_it_fits():
    """At most two (sequence, KV head) programs per SM: five stages on GPUs whose shared memory
    holds them; more programs, other GPUs, head dim 192 and longer launches keep their tiles."""
    from vexact_models.kernels.attention import AttentionConfig, pick_config

    assert pick_config(128, 4, torch.bfloat16, 32 * 8, 132, True) == AttentionConfig(16, 64, 4, 5, True)
    assert pick_config(128, 4, torch.bfloat16, 264, 132, True).num_stages == 5
    assert pick_config(128, 4, torch.bfloat16, 265, 132, True) == AttentionConfig(16, 64, 2, 3, True)
    assert pick_config(128, 4, torch.bfloat16, 32 * 8, 108, False) == AttentionConfig(16, 64, 4, 3, True)  # an A100
    assert pick_config(128, 4, torch.bfloat16) == AttentionConfig(16, 64, 4, 3, True)  # nothing known: as before
    assert pick_config(192, 16, torch.bfloat16, 16, 132, True) == AttentionConfig(16, 64, 2, 1)
    assert pick_config(128, 64, torch.bfloat16, 8, 132, True).num_stages == 2


def test_decode_launches_of_few_programs_read_pages_by_tma_at_three_stages():
    """TMA page copies overlap at three stages (two buffers), where pointer loads need five; a
    launch of many programs keeps the pointer loads' three stages (TMA did not pay there)."""
    from vexact_models.kernels.attention import AttentionConfig, few_decode_programs, pick_config

    assert pick_config(128, 4, torch.bfloat16, 32 * 8, 132, True, True) == AttentionConfig(16, 64, 4, 3, True)
    assert few_decode_programs(264, 132, True) and not few_decode_programs(265, 132, True)
    assert not few_decode_programs(8, 132, False) and not few_decode_programs(0, 132, True)


def test_decode_launches_read_pages_by_tma_only_where_they_are_few(monkeypatch):
    """Only a launch of at most two (sequence, KV head) programs per SM takes TMA page copies by
    default (Qwen3's 32 sequences of 8 KV heads); 128 and 256 sequences keep pointer loads, whose
    tiles are two warps on Hopper (H200, 2026-11-28: TMA pages 0.97x at 256 sequences)."""
    import importlib

    module = importlib.import_module("vexact_models.kernels.attention")
    chosen = []
    monkeypatch.setattr(module, "num_sms", lambda device: 132)
    monkeypatch.setattr(module, "deep_pipeline", lambda device: True)
    monkeypatch.setattr(module, "page_descriptors_fit", lambda k, v, page, rows: True)
    monkeypatch.setattr(module, "_kv_descriptor", lambda x, block_n: None)
    monkeypatch.setattr(module, "launch_staged",
                        lambda fn, grid, args, kwargs, *a, **kw: chosen.append((kwargs["PAGE_DESC"], kwargs["num_warps"])))
    for seqs in (256, 128, 32):
        q = torch.randn(seqs, 16, 128).bfloat16()
        k = torch.randn(seqs, 64, 8, 128).bfloat16()
        layout = PagedLayout(torch.arange(seqs + 1, dtype=torch.int32), torch.full((seqs,), 64, dtype=torch.int32),
                             torch.arange(seqs, dtype=torch.int32)[:, None], 64, 1)
        module.attention_triton(q, k, k, layout, 0.1)
    assert chosen == [(False, 2), (False, 2), (True, 4)]  # 2,048 programs; 1,024; 256 (few: two per SM or fewer)


def test_deep_pipeline_is_a_cuda_property():
    from vexact_models.kernels._triton import deep_pipeline

    assert deep_pipeline("cpu") is False


def test_page_descriptors_fit_decode_launches_over_pages_of_whole_blocks(monkeypatch):
    """Whole key blocks come by TMA page by page only for decode tiles (<= 16 rows per sequence),
    16-bit caches and pages of a multiple of the 64-key block, on top of `kv_descriptors_fit`."""
    import importlib

    module = importlib.import_module("vexact_models.kernels.attention")
    monkeypatch.setattr(module, "has_tma", lambda device: True)
    k, v = (torch.randn(256, 8, 128).bfloat16() for _ in range(2))
    assert module.page_descriptors_fit(k, v, 64, 4) and module.page_descriptors_fit(k, v, 128, 16)
    assert not module.page_descriptors_fit(k, v, 16, 4)  # a block spans four pages
    assert not module.page_descriptors_fit(k, v, 64, 17)  # a prefill chunk's tile
    assert not module.page_descriptors_fit(k.float(), v.float(), 64, 4)


def test_page_descriptors_refuse_pages_that_split_a_block():
    from vexact_models.kernels.attention import attention_triton

    q, k, v, _ = _packed([4], 2, 2, 64, dtype=torch.bfloat16)
    layout = PagedLayout(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                         torch.zeros(1, 1, dtype=torch.int32), 16, 1)
    with pytest.raises(ValueError, match="page_descriptors=True needs .*page_size=16"):
        attention_triton(q[:1], k, v, layout, 0.1, page_descriptors=True)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="TMA loads need a Hopper or newer GPU")
@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8)])  # Qwen3-0.6B, Qwen3-8B
def test_decode_by_page_tma_equals_pointer_loads_and_training_bitwise(hq, hkv):
    """Decode over shuffled pages of 64 (NaN in every unwritten slot): whole key blocks by TMA
    (the default for so few programs), the same launch by pointer loads, and the packed training
    forward agree bitwise."""
    from vexact_models.kernels.attention import attention_triton, page_descriptors_fit

    d, page = 128, 64
    lens = [1, 63, 64, 65, 200, 517]
    gen = torch.Generator().manual_seed(hq)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=gen).bfloat16().cuda() for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    packed = attention_packed(q, k, v, cu.cuda(), max(lens))
    table = shuffled_block_table(lens, page, gen)
    kc, vc = (paged_cache(x, lens, table, page).cuda() for x in (k, v))
    layout = PagedLayout(torch.arange(len(lens) + 1, dtype=torch.int32).cuda(),
                         torch.tensor(lens, dtype=torch.int32).cuda(), table.cuda(), page, 1)
    last = (cu[1:] - 1).long().cuda()
    assert page_descriptors_fit(kc, vc, page, hq // hkv)
    by_tma, lse_tma = attention_triton(q[last], kc, vc, layout, d ** -0.5)
    by_ptr, lse_ptr = attention_triton(q[last], kc, vc, layout, d ** -0.5, page_descriptors=False)
    assert torch.equal(by_tma, by_ptr) and torch.equal(lse_tma, lse_ptr)
    assert torch.equal(by_tma, packed[last]) and not by_tma.isnan().any()
    # programs taking the sequences longest first (the engine's PagedLayout.seq_order): the same bits
    ordered = dataclasses.replace(layout, seq_order=torch.tensor(lens).argsort(descending=True).int().cuda())
    for tma in (True, False):
        out, lse = attention_triton(q[last], kc, vc, ordered, d ** -0.5, page_descriptors=tma)
        assert torch.equal(out, by_tma) and torch.equal(lse, lse_tma), tma


def test_head_dim_256_takes_pointer_loads_and_64_row_tiles(monkeypatch):
    """Qwen3.5's and Qwen3-Next's head dim 256 is taken (keys and values); its K/V blocks come by
    pointer loads, not TMA (`TMA_HEAD_DIMS`), and its training tiles hold 64 rows."""
    import importlib

    from vexact_models.kernels.attention_tiles import HEAD_DIMS, VALUE_HEAD_DIMS, AttentionConfig, pick_config

    module = importlib.import_module("vexact_models.kernels.attention")
    assert 256 in HEAD_DIMS and 256 in VALUE_HEAD_DIMS
    monkeypatch.setattr(module, "has_tma", lambda device: True)
    _, k, v, _ = _packed([4, 8], 4, 2, 256, dtype=torch.bfloat16)
    assert not module.kv_descriptors_fit(k, v)
    assert not module.page_descriptors_fit(k, v, 64, 8)
    assert pick_config(256, 4096, torch.bfloat16) == AttentionConfig(64, 64, 8, 2)  # no spills (test_kernel_resources)
    assert pick_config(256, 40, torch.bfloat16) == AttentionConfig(64, 64, 8, 2)
    assert pick_config(256, 8, torch.bfloat16) == AttentionConfig(16, 64, 4, 2, heads_fastest=True)
    assert pick_config(128, 4096, torch.bfloat16).block_m == 128  # the others keep theirs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv", [(16, 2), (16, 4)])  # Qwen3.5-35B-A3B, Qwen3.5 dense
def test_head_dim_256_training_prefill_and_decode_bitwise(hq, hkv):
    """Head dim 256 on the GPU: the packed training forward, a chunked prefill over shuffled pages
    (NaN in unwritten slots) and decode steps give each token bitwise the same output and lse, close
    to float64 math; the backward is close to float64 autograd."""
    from vexact_models.kernels.attention import attention_triton

    d, page = 256, 16
    lens = [1, 63, 64, 65, 300]
    gen = torch.Generator().manual_seed(hq + hkv)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=gen).bfloat16().cuda() for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    packed, lse = attention_triton(q, k, v, packed_layout(cu.cuda(), max(lens)), d ** -0.5)
    want = attention_math(q.double(), k.double(), v.double(), cu.cuda(), d ** -0.5)
    assert float((packed.double() - want).norm() / want.norm()) < 1e-2
    table = shuffled_block_table(lens, page, gen)
    kc, vc = (paged_cache(x, lens, table, page).cuda() for x in (k, v))
    for chunk in (1, 7, 64):  # each sequence's last `chunk` tokens after the rest as context
        q_lens = [min(chunk, n) for n in lens]
        rows = torch.cat([torch.arange(e - c, e) for e, c in zip(cu[1:].tolist(), q_lens)]).cuda()
        q_cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32).cuda()
        layout = PagedLayout(q_cu, torch.tensor(lens, dtype=torch.int32).cuda(), table.cuda(), page, max(q_lens))
        out, out_lse = attention_triton(q[rows], kc, vc, layout, d ** -0.5)
        assert torch.equal(out, packed[rows]) and torch.equal(out_lse, lse[rows]), chunk
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    g = torch.randn(t, hq, d, generator=gen).bfloat16().cuda()
    got = torch.autograd.grad(attention_packed(qg, kg, vg, cu.cuda(), max(lens), d ** -0.5), (qg, kg, vg), g)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attention_math(qd, kd, vd, cu.cuda(), d ** -0.5), (qd, kd, vd), g.double())
    for a, b in zip(got, want):
        assert float((a.double() - b).norm() / b.norm()) < 2e-2


def test_shuffled_pages_and_paged_cache_hold_the_packed_sequences():
    """The GPU tests' fixture (tests/conftest.py): attention over the shuffled pages equals the
    packed forward at every sequence's last token, and unwritten slots hold NaN."""
    lens, page = [1, 5, 9], 4
    gen = torch.Generator().manual_seed(0)
    q, k, v, cu = _packed(lens, 4, 2, 16, dtype=torch.float32)
    table = shuffled_block_table(lens, page, gen)
    assert sorted(table[0, :1].tolist() + table[1, :2].tolist() + table[2, :3].tolist()) == list(range(6))
    kc, vc = (paged_cache(x, lens, table, page) for x in (k, v))
    assert kc.shape == (24, 2, 16) and int(kc.isnan().any(-1).any(-1).sum()) == 24 - sum(lens)
    last = (cu[1:] - 1).long()
    layout = PagedLayout(torch.arange(len(lens) + 1, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                         table, page, 1)
    assert torch.equal(attention(q[last], kc, vc, layout), attention_packed(q, k, v, cu, max(lens))[last])
