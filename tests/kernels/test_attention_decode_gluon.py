"""The Gluon GQA decode kernel (`kernels.attention_decode_gluon`, work in progress): where it may
take a launch (CPU), and on a Hopper GPU the Triton decode launch's bits over shuffled pages with
NaN in every unwritten slot, in arrival and longest-first order, with a CUDA-graph padding
sequence, at every GQA group our models have."""

import dataclasses

import pytest
import torch

from vexact_models.kernels import attention_decode_gluon, gluon_support
from vexact_models.kernels.attention import attention_triton

from ..conftest import paged_cache, paged_layout, shuffled_pages

D = attention_decode_gluon.HEAD_DIM


def test_shape_fits_decode_launches_of_head_dim_128_and_groups_up_to_8_over_whole_block_pages():
    q = torch.zeros(3, 32, D, dtype=torch.bfloat16)
    k = torch.zeros(256, 8, D, dtype=torch.bfloat16)
    step = paged_layout([1, 1, 1], [70, 5, 600], torch.zeros(3, 10, dtype=torch.int32), 64)
    assert attention_decode_gluon.shape_fits(q, k, k, step)
    assert not attention_decode_gluon.shape_fits(q, k, k, dataclasses.replace(step, page_size=16))
    assert not attention_decode_gluon.shape_fits(q, k, k, dataclasses.replace(step, max_seqlen_q=2))  # a chunk
    assert not attention_decode_gluon.shape_fits(q.float(), k.float(), k.float(), step)
    assert not attention_decode_gluon.shape_fits(q[..., :64], k[..., :64], k[..., :64], step)
    assert not attention_decode_gluon.shape_fits(torch.zeros(3, 16, D, dtype=torch.bfloat16), k[:, :1], k[:, :1],
                                                 step)  # a group of 16 (MHA-style sharing) is past MAX_GROUP
    assert not attention_decode_gluon.fits(q, k, k, step)  # CPU tensors
    with pytest.raises(ValueError, match="attention_decode_gluon: this launch does not fit the kernel"):
        attention_decode_gluon.attention_decode_gluon(q, k, k, step, 0.1)


def test_every_config_fits_the_registers_and_shared_memory_of_its_programs_an_sm():
    for stages, per_sm, consumer, producer, _ in attention_decode_gluon.CONFIGS:
        assert per_sm * (2 * consumer + producer) // 3 // 8 * 8 * 384 <= 65536  # 12 warps a program, maxnreg
        assert per_sm * (stages * 32 + 7) <= 227  # K/V stages, queries, P and barriers, KB


def test_decode_switch_defaults_to_triton_and_names_a_bad_value(monkeypatch):
    assert attention_decode_gluon.ATTENTION_DECODE.default == "triton"  # until measured on a GPU
    monkeypatch.setenv("VEXACT_ATTENTION_DECODE", "cuda")
    with pytest.raises(ValueError, match="VEXACT_ATTENTION_DECODE='cuda'.*'triton', 'gluon'"):
        attention_decode_gluon.ATTENTION_DECODE.mode()


needs_gluon = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
                                      and gluon_support.HAS_GLUON),
                                 reason="the Gluon kernel needs a Hopper GPU and a verified Triton")


@needs_gluon
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8), (28, 4), (32, 4)])
def test_decode_equals_the_triton_launch_bitwise(heads, kv_heads, monkeypatch):
    """Decode steps over shuffled pages of 64 (NaN in every unwritten slot), sequences of 1-1,100
    keys (partial last blocks, a block exactly full), a padding sequence with no query token, in
    arrival and longest-first order: the Triton decode launch's output and lse, bitwise."""
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    lens, page = [1, 40, 63, 64, 65, 200, 517, 1100], 64
    t = sum(lens)
    k = torch.randn(t, kv_heads, D, generator=gen).bfloat16()
    v = torch.randn(t, kv_heads, D, generator=gen).bfloat16()
    table = shuffled_pages(lens + [64], page, gen)  # the padding sequence's row: one page, never read
    k_cache = paged_cache(k, lens, table[:-1], page).cuda()
    v_cache = paged_cache(v, lens, table[:-1], page).cuda()
    q = torch.randn(len(lens), heads, D, generator=gen).bfloat16().cuda()
    step = paged_layout([1] * len(lens) + [0], lens + [0], table, page, "cuda")
    scale = D ** -0.5
    want, want_lse = attention_triton(q, k_cache, v_cache, step, scale)
    assert not want.isnan().any()
    ordered = dataclasses.replace(step, seq_order=torch.tensor(lens + [0]).argsort(descending=True).int().cuda())
    calls, run = [], attention_decode_gluon.attention_decode_gluon
    monkeypatch.setattr(attention_decode_gluon, "attention_decode_gluon", lambda *a, **kw: calls.append(a) or run(*a, **kw))
    with attention_decode_gluon.ATTENTION_DECODE.use("gluon"):  # the routed launch
        out, lse = attention_triton(q, k_cache, v_cache, step, scale)
    assert len(calls) == 1 and torch.equal(out, want) and torch.equal(lse, want_lse)
    for config in attention_decode_gluon.CONFIGS:
        for lay in (step, ordered):
            out, lse = attention_decode_gluon.attention_decode_gluon(q, k_cache, v_cache, lay, scale, config)
            assert torch.equal(out, want) and torch.equal(lse, want_lse), config
