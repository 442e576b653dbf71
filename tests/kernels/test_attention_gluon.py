"""The Gluon GQA prefill and training kernel (`kernels.attention_gluon`): where it takes a launch
(CPU), and on a Hopper GPU the Triton launch's bits for chunked prefill over shuffled pages, the
decode steps after them and packed training, whichever stages and register split a program runs."""

import dataclasses

import pytest
import torch

from vexact_models.kernels import attention_gluon, attention_packed, gluon_support
from vexact_models.kernels.attention import attention_triton, packed_layout
from vexact_models.kernels.attention_tiles import BLOCK_M
from vexact_models.kernels.paged_layout import shuffled_block_table

from ..conftest import compiled_variants, paged_cache, paged_layout

D = attention_gluon.HEAD_DIM


def test_shape_fits_training_and_prompt_launches_of_head_dim_128_over_whole_block_pages_or_packed_rows():
    q = torch.zeros(100, 32, D, dtype=torch.bfloat16)
    k = torch.zeros(256, 8, D, dtype=torch.bfloat16)
    paged = paged_layout([40, 60], [70, 60], torch.zeros(2, 2, dtype=torch.int32), 64)  # 60 tokens x 4 heads > 64 rows
    assert attention_gluon.shape_fits(q, k, k, paged)
    assert not attention_gluon.shape_fits(q, k, k, dataclasses.replace(paged, page_size=16))
    assert not attention_gluon.shape_fits(q, k, k, dataclasses.replace(paged, max_seqlen_q=16))  # 64 rows: a short chunk
    assert not attention_gluon.shape_fits(q, k, k, dataclasses.replace(paged, max_seqlen_q=1))  # decode
    assert not attention_gluon.shape_fits(q.float(), k.float(), k.float(), paged)
    assert not attention_gluon.shape_fits(q[..., :64], k[..., :64], k[..., :64], paged)  # head dim 64
    assert not attention_gluon.shape_fits(q[:, :30], k, k, paged)  # 30 heads over 8 KV heads
    fused = torch.zeros(256, 48, D, dtype=torch.bfloat16)  # q, k, v as views of one projection's rows
    assert attention_gluon.shape_fits(fused[:100, :32], fused[:, 32:40], fused[:, 40:], paged)
    packed = packed_layout(torch.tensor([0, 40, 100], dtype=torch.int32), 60)
    assert attention_gluon.shape_fits(q, k[:100], k[:100], packed, contiguous=True)
    assert not attention_gluon.shape_fits(q, k[:100], k[:100], packed)  # pages of 1 slot: not contiguous rows
    assert not attention_gluon.fits(q, k, k, paged)  # CPU tensors
    with pytest.raises(ValueError, match="attention_prefill_gluon: this launch does not fit the kernel"):
        attention_gluon.attention_prefill_gluon(q, k, k, paged, 0.1)


def test_prefill_switch_defaults_to_gluon_and_names_a_bad_value(monkeypatch):
    assert attention_gluon.ATTENTION_PREFILL.default == "gluon"
    monkeypatch.setenv("VEXACT_ATTENTION_PREFILL", "cuda")
    with pytest.raises(ValueError, match="VEXACT_ATTENTION_PREFILL='cuda'.*'gluon', 'triton'"):
        attention_gluon.ATTENTION_PREFILL.mode()


def test_launch_config_takes_five_stages_up_to_8k_tokens_and_four_beyond():
    assert attention_gluon.launch_config(1) == attention_gluon.launch_config(8192) == (5, 224, 56)
    assert attention_gluon.launch_config(8193) == attention_gluon.launch_config(32768) == (4, 232, 40)
    for stages, consumer, producer in (attention_gluon.SHORT_CONFIG, attention_gluon.LONG_CONFIG):
        assert 2 * 128 * consumer + 128 * producer <= 65536 and stages * 32 <= 227  # registers; K/V stages in KB


def test_a_launch_of_short_chunks_keeps_the_triton_tiles():
    """At most `BLOCK_M` rows a sequence (a decode step, a short chunk) is not this kernel's launch."""
    q = torch.zeros(16, 32, D, dtype=torch.bfloat16)
    k = torch.zeros(64, 8, D, dtype=torch.bfloat16)
    layout = paged_layout([16], [64], torch.zeros(1, 1, dtype=torch.int32), 64)
    assert 16 * 4 == BLOCK_M and not attention_gluon.shape_fits(q, k, k, layout)


needs_gluon = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
                                      and gluon_support.HAS_GLUON),
                                 reason="the Gluon kernel needs a Hopper GPU and a verified Triton")
#: (stages, consumer registers, producer registers): every one must give the same bits
CANDIDATES = (attention_gluon.SHORT_CONFIG, attention_gluon.LONG_CONFIG, (2, 232, 40))
SHAPES = [(16, 8), (32, 8), (28, 4), (32, 4)]  # Qwen3-0.6B, Qwen3-8B / Llama-3.1-8B, Qwen2.5-7B, Qwen3-30B-A3B


def _gluon_calls(monkeypatch) -> list:
    calls, run = [], attention_gluon.attention_prefill_gluon
    monkeypatch.setattr(attention_gluon, "attention_prefill_gluon", lambda *a, **k: calls.append(a) or run(*a, **k))
    return calls


def _qkv(lens, heads, kv_heads, gen, dtype=torch.bfloat16):
    """q, k, v as views of one fused projection's rows, as a model's training forward hands them over."""
    t = sum(lens)
    fused = torch.randn(t, heads + 2 * kv_heads, D, generator=gen).to(dtype).cuda()
    return fused[:, :heads], fused[:, heads:heads + kv_heads], fused[:, heads + kv_heads:]


@needs_gluon
@pytest.mark.parametrize("heads,kv_heads", SHAPES)
def test_the_training_forward_runs_the_gluon_kernel_with_the_triton_launchs_bits(heads, kv_heads, monkeypatch):
    """Over packed training K/V (keys in consecutive rows; sequences shorter than a tile, and of
    lengths off the 64-key blocks, whose last block the kernel copies whole and zeroes past the
    sequence) the training forward runs the Gluon kernel and gives the Triton launch's output and
    lse, with TMA and with pointer loads; so does every candidate launch."""
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads)
    lens = [1, 63, 64, 65, 200, 1000, 2049]
    q, k, v = _qkv(lens, heads, kv_heads, gen)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).cuda()
    layout, scale = packed_layout(cu, max(lens)), D ** -0.5
    with attention_gluon.ATTENTION_PREFILL.use("triton"):
        want = attention_packed(q, k, v, cu, max(lens))
        tma, tma_lse = attention_triton(q, k, v, layout, scale, kv_descriptors=True)
        pointers, pointers_lse = attention_triton(q, k, v, layout, scale)
    assert torch.equal(tma, want) and torch.equal(pointers, want) and torch.equal(pointers_lse, tma_lse)
    calls = _gluon_calls(monkeypatch)
    assert torch.equal(attention_packed(q, k, v, cu, max(lens)), want)
    assert len(calls) == 1  # training: the Gluon kernel
    out, lse = attention_triton(q, k, v, layout, scale, kv_descriptors=True)
    assert torch.equal(out, want) and torch.equal(lse, tma_lse) and len(calls) == 2
    for cand in CANDIDATES:
        out, lse = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda"), torch.empty(q.shape[:2], device="cuda")
        attention_gluon.launch(q, k, v, layout, scale, out, lse, *cand)
        assert torch.equal(out, want) and torch.equal(lse, tma_lse), cand


@needs_gluon
@pytest.mark.parametrize("heads,kv_heads", SHAPES[:3])  # 30B-A3B's group of 8: the training test
def test_chunked_prefill_and_decode_equal_training_bitwise(heads, kv_heads, monkeypatch):
    """Prompts in two chunks over shuffled pages of 64 (NaN in every unwritten slot), the second
    attending to the first as context, then decode steps: the Gluon chunks, every candidate,
    longest-first order, the Triton launch, the Triton decode steps and packed training agree."""
    gen = torch.Generator().manual_seed(heads + kv_heads)
    lens, page = [3, 40, 63, 64, 65, 200, 517, 1100], 64
    q, k, v = _qkv(lens, heads, kv_heads, gen)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    with attention_gluon.ATTENTION_PREFILL.use("triton"):
        trained = attention_packed(q, k, v, cu.cuda(), max(lens))
    table = shuffled_block_table(lens, page, gen)
    k_cache, v_cache = paged_cache(k, lens, table, page).cuda(), paged_cache(v, lens, table, page).cuda()
    scale = D ** -0.5
    calls = _gluon_calls(monkeypatch)
    for first in ([0] * len(lens), [n // 3 for n in lens]):  # one chunk; then after a first third as context
        second = [n - f for n, f in zip(lens, first)]
        rows = torch.cat([torch.arange(c + f, c + n) for c, f, n in zip(cu[:-1].tolist(), first, lens)]).cuda()
        layout = paged_layout(second, lens, table, page, "cuda")
        with attention_gluon.ATTENTION_PREFILL.use("triton"):
            want, want_lse = attention_triton(q[rows], k_cache, v_cache, layout, scale)
        assert torch.equal(want, trained[rows]) and not want.isnan().any()
        out, lse = attention_triton(q[rows], k_cache, v_cache, layout, scale)  # the default: Gluon
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        ordered = dataclasses.replace(layout, seq_order=torch.tensor(lens).argsort(descending=True).int().cuda())
        for cand in CANDIDATES:
            for lay in (layout, ordered):
                out, lse = torch.full_like(want, float("nan")), torch.empty_like(want_lse)
                attention_gluon.launch(q[rows], k_cache, v_cache, lay, scale, out, lse, *cand)
                assert torch.equal(out, want) and torch.equal(lse, want_lse), cand
    assert len(calls) == 2  # the default launch went to the Gluon kernel, once a chunk
    last = (cu[1:] - 1).cuda()  # each sequence's last token as a decode step over the cache
    step = paged_layout([1] * len(lens), lens, table, page, "cuda")
    assert torch.equal(attention_triton(q[last], k_cache, v_cache, step, scale)[0], trained[last])
    assert len(calls) == 2  # decode keeps the Triton launch


@needs_gluon
def test_one_compile_serves_every_batch_shape():
    """Training batches and prompt steps change the sequence count, the longest sequence (the tile
    count) and the block table's width from launch to launch; none of them compiles the kernel
    again (they are runtime arguments, never specialized on)."""
    gen = torch.Generator().manual_seed(7)
    kernel, seen = attention_gluon._gqa_attention_ws_kernel, None
    # one sequence; 3 of odd lengths; 16 of one block (one tile each); 2; 3 long ones
    for lens in ([100], [65, 300, 17], [64] * 16, [1000, 33], [2049] * 3):
        q, k, v = _qkv(lens, 16, 8, gen)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).cuda()
        out, lse = torch.empty(q.shape, dtype=q.dtype, device="cuda"), torch.empty(q.shape[:2], device="cuda")
        attention_gluon.launch(q, k, v, packed_layout(cu, max(lens)), D ** -0.5, out, lse, *attention_gluon.SHORT_CONFIG)
        seen = compiled_variants(kernel) if seen is None else seen
    assert compiled_variants(kernel) == seen
