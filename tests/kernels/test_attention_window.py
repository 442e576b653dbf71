"""Sliding windows and attention sinks (`kernels/attention_window.py`) on the CPU reference: the
window convention against transformers' own masks, the sink arithmetic against transformers'
GPT-OSS attention (forward and the sinks' gradient), packed vs chunked prefill vs decode bitwise,
the attention contexts' per-call `window=` / `sinks=`, and the argument errors."""

import math

import pytest
import torch

from vexact_models.kernels import PagedLayout, UnsupportedError, attention, attention_packed, use_attention_forward
from vexact_models.kernels.attention_backward import attention_math, sinks_grad
from vexact_models.kernels.attention_forward_choice import choose_attention_forward
from vexact_models.kernels.attention_reference import attention_reference
from vexact_models.kernels.attention_window import (WIDEST_KEY_BLOCK, check_window_and_sinks, window_block_start,
                                                    window_first_key)
from vexact_models.kernels.paged_layout import packed_layout
from vexact_models.layers import PackedContext, PagedContext

from .test_attention import _packed, _run_paged


@pytest.mark.compat
@pytest.mark.parametrize("window", [1, 2, 5, 16])
def test_window_is_transformers_sliding_window(window):
    """A query at position p sees keys p - window + 1 .. p: transformers' sliding-window causal mask."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    hf = sliding_window_causal_mask_function(window)
    for q in range(40):
        for kv in range(40):
            ours = window_first_key(q, window) <= kv <= q
            assert ours == bool(hf(0, 0, torch.tensor(q), torch.tensor(kv))), (q, kv)
    assert window_first_key(3, None) == 0 and window_block_start(200, 10) == 128
    assert window_block_start(200, 10, 16) == 176 and window_block_start(5, 100) == 0


@pytest.mark.compat
def test_layer_window_reads_each_layers_window_as_transformers():
    from transformers import Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig, Qwen3Config

    from vexact_models.layers import layer_window

    assert [layer_window(MistralConfig(sliding_window=5, num_hidden_layers=3), i) for i in range(3)] == [5, 5, 5]
    assert layer_window(MistralConfig(sliding_window=None), 0) is None and layer_window(LlamaConfig(), 0) is None
    gemma = Gemma3TextConfig(sliding_window=7)
    assert [layer_window(gemma, i) for i in range(6)] == [7, 7, 7, 7, 7, None]  # five local layers, then a global
    oss = GptOssConfig()
    assert [layer_window(oss, i) for i in range(4)] == [128, None, 128, None]
    assert layer_window(Qwen3Config(), 0) is None  # use_sliding_window=False
    chunked = MistralConfig(num_hidden_layers=1)
    chunked.layer_types = ["chunked_attention"]
    with pytest.raises(ValueError, match=r"layer_types\[0\]='chunked_attention' is not supported"):
        layer_window(chunked, 0)
    with pytest.raises(ValueError, match="sliding_window=0 must be None or an int >= 1"):
        layer_window(MistralConfig(sliding_window=0), 0)


def _hf_gpt_oss_attention(q, k, v, sinks, scale, window):
    """transformers' GPT-OSS eager attention (sinks) under its own sliding-window mask, on one
    sequence of packed ``[T, H, D]`` tensors."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    n, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, hq // hkv, False
    visible = sliding_window_causal_mask_function(window)
    allowed = torch.tensor([[bool(visible(0, 0, torch.tensor(i), torch.tensor(j))) for j in range(n)] for i in range(n)])
    mask = torch.zeros(n, n, dtype=q.dtype).masked_fill(~allowed, float("-inf"))[None, None]
    out, _ = eager_attention_forward(module, *(t.transpose(0, 1)[None] for t in (q, k, v)), mask, scale)
    return out[0]


@pytest.mark.compat
@pytest.mark.parametrize("window", [3, 8, 100])
def test_sinks_and_window_are_gpt_oss_attention(window):
    """`attention_packed` with sinks and a window equals transformers' GPT-OSS eager attention in
    float64, and so do its gradients, the sinks' included (also `sinks_grad`, the Triton path's
    formula, from the reference's lse)."""
    q, k, v, cu = _packed([23], 4, 2, 8, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ours = attention_packed(*inputs[:3], cu, 23, 0.3, window=window, sinks=inputs[3])
    hf_inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    hf = _hf_gpt_oss_attention(*hf_inputs, 0.3, window)
    assert torch.allclose(ours, hf, atol=1e-12)
    g = torch.randn_like(ours)
    hf_grads = torch.autograd.grad(hf, hf_inputs, g)
    for a, b in zip(torch.autograd.grad(ours, inputs, g), hf_grads):
        assert torch.allclose(a, b, atol=1e-11)
    out, lse = attention_reference(q, k, v, packed_layout(cu, 23), 0.3, True, window, sinks)
    assert torch.allclose(sinks_grad(g, out, lse, sinks), hf_grads[3], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window,with_sinks", [(1, False), (4, True), (17, False), (33, True), (None, True)])
def test_reference_matches_math(dtype, window, with_sinks):
    q, k, v, cu = _packed([5, 17, 1, 40], 4, 2, 16, dtype=dtype)
    sinks = torch.randn(4, dtype=dtype) if with_sinks else None
    out = attention_packed(q, k, v, cu, 40, 0.3, window=window, sinks=sinks)
    ref = attention_math(q.double(), k.double(), v.double(), cu, 0.3, window, None if sinks is None else sinks.double())
    assert (out.double() - ref).abs().max() < (1e-13 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,with_sinks", [(3, False), (16, True), (21, True), (None, True)])
def test_packed_chunked_and_decode_bitwise_with_window_and_sinks(dtype, window, with_sinks):
    """Windows shorter than the sequences (blocks skipped at one path's tile start, masked at
    another's) and sinks: every chunking gives the packed rows bitwise, over NaN-filled pages."""
    lens = [1, 7, 23, 40]
    q, k, v, cu = _packed(lens, 4, 2, 16, dtype=dtype)
    sinks = torch.randn(4).to(dtype) if with_sinks else None
    packed = attention_packed(q, k, v, cu, max(lens), window=window, sinks=sinks)
    assert not packed.isnan().any()
    for chunk in (1, 3, 16):
        assert torch.equal(_run_paged(q, k, v, lens, chunk, window=window, sinks=sinks), packed), chunk


@pytest.mark.parametrize("window,with_sinks", [(None, False), (5, True), (21, False)])
def test_reference_groups_of_blocks_and_sequences_do_not_change_a_bit(monkeypatch, window, with_sinks):
    """The reference takes key blocks several at a time and the sequences with as many queries
    (decode rows) together, `_GROUP_ELEMENTS` bounding the products one group holds: one sequence
    and one block at a time, a few, or all at once give the same bits, and a sequence's rows are
    those it gets alone in the batch."""
    from vexact_models.kernels import attention_reference as module

    gen = torch.Generator().manual_seed(3)
    lens, queries = [1, 9, 40, 70, 33, 64, 17, 5], [1, 9, 1, 1, 4, 1, 4, 1]
    q = torch.randn(sum(queries), 4, 16, generator=gen)
    k, v = torch.randn(40, 8, 2, 16, generator=gen), torch.randn(40, 8, 2, 16, generator=gen)
    table = torch.randperm(40, generator=gen)[:32].reshape(8, 4).int()  # 4 shuffled pages of 8 a sequence
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    layout = PagedLayout(cu, torch.tensor(lens, dtype=torch.int32), table, 8, max(queries))
    sinks = torch.randn(4, generator=gen) if with_sinks else None
    outs = []
    for elements in (1, 2 * 4 * 16 * 16, 1 << 22):  # one at a time; two decode rows a group; all
        monkeypatch.setattr(module, "_GROUP_ELEMENTS", elements)
        outs.append(attention_reference(q, k, v, layout, 0.3, True, window, sinks))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    for s in range(len(lens)):
        alone = PagedLayout(torch.tensor([0, queries[s]], dtype=torch.int32), layout.seq_lens[s:s + 1],
                            table[s:s + 1], 8, queries[s])
        rows = slice(int(cu[s]), int(cu[s + 1]))
        assert torch.equal(attention_reference(q[rows], k, v, alone, 0.3, False, window, sinks), outs[-1][0][rows])


def test_contexts_pass_window_and_sinks_through():
    """`PackedContext.attend` and `PagedContext.attend` (then `attend_cache`) with a layer's window
    and sinks give the same bits, and differ from the call without them."""
    q, k, v, cu = _packed([30], 4, 2, 16)
    sinks = torch.randn(4)
    packed = PackedContext(cu, 30).attend(0, q, k, v, 0.25, window=6, sinks=sinks)
    caches = tuple(torch.zeros(30, 1, 2, 16) for _ in range(2))
    layout = PagedLayout(cu, torch.tensor([30], dtype=torch.int32), torch.arange(30, dtype=torch.int32)[None], 1, 30)
    paged = PagedContext(layout, torch.arange(30), [caches]).attend(0, q, k, v, 0.25, window=6, sinks=sinks)
    assert torch.equal(paged, packed)
    assert not torch.equal(PackedContext(cu, 30).attend(0, q, k, v, 0.25), packed)
    assert not torch.equal(PackedContext(cu, 30).attend(0, q, k, v, 0.25, window=6), packed)


def test_attend_rotary_passes_window_and_sinks_on_both_contexts():
    """The fused rollout path (`rotary_cache_write`, then `attend_cache`) and the separate one
    (module norms) take the layer's window and sinks as training's `attend_rotary` does."""
    from vexact_models.kernels import rope_table
    from vexact_models.layers import RMSNorm

    q, k, v, cu = _packed([30], 4, 2, 16)
    sinks, positions = torch.randn(4), torch.arange(30)
    rope = rope_table(1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16)), 64)
    layout = PagedLayout(cu, torch.tensor([30], dtype=torch.int32), torch.arange(30, dtype=torch.int32)[None], 1, 30)
    for norms in ((None, None), (RMSNorm(16), RMSNorm(16, eps=0.5))):
        packed = PackedContext(cu, 30).attend_rotary(0, q, k, v, positions, rope, 0.25, *norms, window=5, sinks=sinks)
        caches = tuple(torch.zeros(30, 1, 2, 16) for _ in range(2))
        with torch.no_grad():
            paged = PagedContext(layout, torch.arange(30), [caches]).attend_rotary(0, q, k, v, positions, rope, 0.25,
                                                                                   *norms, window=5, sinks=sinks)
        assert torch.equal(paged, packed)
        assert not torch.equal(PackedContext(cu, 30).attend_rotary(0, q, k, v, positions, rope, 0.25, *norms), packed)


def test_window_and_sinks_errors():
    q, k, v, cu = _packed([5], 4, 2, 16)
    layout = packed_layout(cu, 5)
    for window in (0, -3, True, 2.0):
        with pytest.raises(ValueError, match=f"window={window!r} must be None"):
            attention_packed(q, k, v, cu, 5, window=window)
    with pytest.raises(ValueError, match="sinks has 3 logits, q has 4 query heads"):
        attention(q, k, v, layout, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks must be a floating 1-D tensor.*torch.int64"):
        check_window_and_sinks("attention", q, None, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="sinks on meta, q on cpu"):
        check_window_and_sinks("attention", q, None, torch.zeros(4, device="meta"))
    latent = torch.randn(5, 1, 24)
    with pytest.raises(ValueError, match="not supported for latent MLA"):
        attention(torch.randn(5, 4, 24), latent, latent[..., :16], layout, window=3)
    with use_attention_forward("fa4"), pytest.raises(UnsupportedError, match="sliding window or attention sinks"):
        choose_attention_forward(q, k, v, windowed=True)
    assert WIDEST_KEY_BLOCK % 16 == 0 and math.log2(WIDEST_KEY_BLOCK).is_integer()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv,d,window,with_sinks", [(64, 8, 64, 128, True), (64, 8, 64, None, True),
                                                        (8, 4, 256, 512, False), (32, 8, 128, 300, False)])
def test_gpu_training_prefill_and_decode_bitwise_with_window_and_sinks(hq, hkv, d, window, with_sinks):
    """GPT-OSS, Gemma 3 and Mistral shapes on the GPU with the launches `attention` picks itself
    (TMA pages for few decode programs, the training tiles, prompt chunks): the packed training
    forward, prompt chunks and decode over shuffled pages of 64 (NaN in unwritten slots) agree
    bitwise; the backward matches float64 autograd, the sinks' gradient included."""
    from ..conftest import paged_cache, paged_layout
    from vexact_models.kernels.paged_layout import shuffled_block_table

    lens, page = [1, 100, 700, 1500], 64
    gen = torch.Generator().manual_seed(d + hq)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=gen).bfloat16().cuda() for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen).cuda() if with_sinks else None
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    packed = attention_packed(q, k, v, cu.cuda(), max(lens), window=window, sinks=sinks)
    table = shuffled_block_table(lens, page, gen)
    kc, vc = (paged_cache(x, lens, table, page).cuda() for x in (k, v))
    for chunk in (1, 37, 300):  # each sequence's last `chunk` tokens after the rest as context
        q_lens = [min(chunk, n) for n in lens]
        rows = torch.cat([torch.arange(int(e) - c, int(e)) for e, c in zip(cu[1:], q_lens)]).cuda()
        layout = paged_layout(q_lens, lens, table, page, "cuda")
        out = attention(q[rows], kc, vc, layout, d ** -0.5, window=window, sinks=sinks)
        assert not out.isnan().any() and torch.equal(out, packed[rows]), chunk
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    inputs = (q, k, v) + ((sinks.requires_grad_(),) if with_sinks else ())
    g = torch.randn(t, hq, d, generator=gen).bfloat16().cuda()
    got = torch.autograd.grad(attention_packed(q, k, v, cu.cuda(), max(lens), window=window, sinks=sinks), inputs, g)
    ref = tuple(x.detach().double().requires_grad_() for x in inputs)
    want = torch.autograd.grad(attention_math(*ref[:3], cu.cuda(), d ** -0.5, window, ref[3] if with_sinks else None),
                               ref, g.double())
    for a, b in zip(got, want):
        assert (a.double() - b).norm() / b.norm() < 2e-2
