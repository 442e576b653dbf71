"""`rotary_cache_write`'s kernel against the separate ops it replaces in rollouts (`rms_norm`,
`apply_rotary`, `kv_cache_write`), bitwise: under TRITON_INTERPRET=1 on CPU (its logic) and on a
GPU (where the norm's row sums must also follow the norm kernel's order)."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels import rope_table, rotary_cache_write  # noqa: E402
from vexact_models.kernels.rotary_cache_write import rotary_cache_write_reference  # noqa: E402

DTYPES = [torch.float32] if INTERPRET else [torch.bfloat16, torch.float32]


def _inputs(tokens, q_heads, kv_heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    width = (q_heads + 2 * kv_heads) * head_dim
    # one fused projection's output, split into views, as the rollout's q/k/v are
    qkv = (torch.randn(tokens, width, generator=g) * 3).to(dtype).to(DEVICE)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.randint(0, 4000, (tokens,), generator=g).to(DEVICE)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = (t.to(DEVICE) for t in rope_table(inv_freq, 4096))
    weights = [(1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE) for _ in range(2)]
    slots = torch.randperm(3 * tokens, generator=g)[:tokens]
    slots[::5] = -1  # padding tokens of a captured graph write nothing
    return q, k, v, positions, cos, sin, weights, slots.to(DEVICE)


def _caches(tokens, kv_heads, head_dim, dtype):
    # [pages, page_size, kv_heads, head_dim], with a sentinel that unwritten rows must keep
    return [torch.full((3 * tokens // 4 + 1, 4, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE) for _ in range(2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim", [(1, 16, 8, 128), (7, 32, 8, 128), (70, 4, 2, 64),
                                                                  (5, 8, 8, 32)])
def test_rotary_cache_write_is_the_separate_ops(tokens, q_heads, kv_heads, head_dim, norm, dtype):
    q, k, v, positions, cos, sin, weights, slots = _inputs(tokens, q_heads, kv_heads, head_dim, dtype, tokens + q_heads)
    norm_weights = weights if norm else [None, None]
    want_k, want_v = _caches(tokens, kv_heads, head_dim, dtype)
    want_q = rotary_cache_write_reference(q, k, v, positions, cos, sin, want_k, want_v, slots, *norm_weights, 1e-6)
    got_k, got_v = _caches(tokens, kv_heads, head_dim, dtype)
    got_q = rotary_cache_write(q, k, v, positions, cos, sin, got_k, got_v, slots, *norm_weights, 1e-6)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)
    assert not torch.equal(got_q, q)  # the queries were rotated
    assert (got_k == 7.0).any()  # rows of padding tokens and unused slots kept the sentinel


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seqs, q_heads, kv_heads, head_dim", [(5, 16, 8, 128), (3, 32, 8, 128), (4, 8, 1, 64)])
def test_attention_decode_rotary_is_rotary_cache_write_then_attention(seqs, q_heads, kv_heads, head_dim, norm):
    """The fused decode launch (`attention_rotary.attention_decode_rotary`) gives the output and
    the caches of `rotary_cache_write` followed by the decode attention (the kernel's own
    `attention_triton`, pointer loads, the same 16-row tiles), bitwise: one query token per
    sequence, sequences ending before, at and after a key block's end, pages in shuffled order,
    padding tokens (slot -1, as a captured graph's) writing nothing."""
    from vexact_models.kernels.attention import PagedLayout, attention_triton
    from vexact_models.kernels.attention_rotary import attention_decode_rotary, decode_rotary_fits

    dtype, page = (torch.float32 if INTERPRET else torch.bfloat16), 16
    q, k, v, _, cos, sin, weights, _ = _inputs(seqs, q_heads, kv_heads, head_dim, dtype, seqs + q_heads)
    norm_weights = weights if norm else [None, None]
    g = torch.Generator().manual_seed(seqs * 7 + kv_heads)
    lens = [64, 1, 65, 130, 63, 200][:seqs]  # keys per sequence, the new token's included
    pages = [-(-n // page) for n in lens]
    ids = torch.randperm(sum(pages), generator=g).tolist()
    table = torch.tensor([ids[sum(pages[:s]):sum(pages[:s + 1])] + [0] * (max(pages) - pages[s]) for s in range(seqs)],
                         dtype=torch.int32)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([int(table[s, (n - 1) // page]) * page + (n - 1) % page for s, n in enumerate(lens)])
    slots[-1] = -1  # a padding token: writes nothing (its attention still runs over what the cache holds)
    caches = [(torch.randn(sum(pages) * page, kv_heads, head_dim, generator=g) * 2).to(dtype) for _ in range(2)]
    layout = PagedLayout(torch.arange(seqs + 1, dtype=torch.int32).to(DEVICE), torch.tensor(lens, dtype=torch.int32).to(DEVICE),
                         table.to(DEVICE), page, 1)
    want_k, want_v = (c.clone().to(DEVICE) for c in caches)
    rotated = rotary_cache_write(q, k, v, positions.to(DEVICE), cos, sin, want_k, want_v, slots.to(DEVICE), *norm_weights,
                                 1e-6)
    want = attention_triton(rotated, want_k, want_v, layout, head_dim ** -0.5, page_descriptors=False)[0]
    got_k, got_v = (c.clone().to(DEVICE) for c in caches)
    assert decode_rotary_fits(q, k, v, got_k, got_v, layout)
    got = attention_decode_rotary(q, k, v, positions.to(DEVICE), cos, sin, got_k, got_v, slots.to(DEVICE), layout,
                                  head_dim ** -0.5, *norm_weights, 1e-6)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.equal(got, want)
    assert not torch.equal(got_k, caches[0].to(DEVICE))  # the new keys were written
    unfused = PagedLayout(layout.cu_seqlens_q, layout.seq_lens, layout.block_table, page, 2)
    assert not decode_rotary_fits(q, k, v, got_k, got_v, unfused)  # not a decode launch
    assert not decode_rotary_fits(q.contiguous(), k, v, got_k, got_v, layout)  # not views of one projection row
    with pytest.raises(ValueError, match="do not fit the fused decode launch"):
        attention_decode_rotary(q.contiguous(), k, v, positions.to(DEVICE), cos, sin, got_k, got_v, slots.to(DEVICE),
                                unfused, head_dim ** -0.5)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_paged_context_takes_the_fused_decode_launch_only_when_switched_on(monkeypatch, mode):
    """`PagedContext.attend_rotary` (the Qwen3 layers' decode path) runs the fused launch under
    ``VEXACT_DECODE_ROTARY=on`` instead of `rotary_cache_write` + `attention`, with the same
    output and caches; off (the default), the two ops as before."""
    from vexact_models import layers
    from vexact_models.kernels.attention import PagedLayout
    from vexact_models.kernels.attention_rotary import use_decode_rotary

    seqs, q_heads, kv_heads, head_dim, page = 3, 8, 2, 64, 64
    q, k, v, _, cos, sin, weights, _ = _inputs(seqs, q_heads, kv_heads, head_dim, torch.float32, 11)
    norms = []
    for w in weights:
        norm = layers.RMSNorm(head_dim).to(DEVICE)
        norm.weight.data = w.clone()
        norms.append(norm)
    lens = [5, 64, 33]
    table = torch.tensor([[2], [0], [1]], dtype=torch.int32)
    positions = torch.tensor([n - 1 for n in lens]).to(DEVICE)
    slots = torch.tensor([int(table[s, (n - 1) // page]) * page + (n - 1) % page for s, n in enumerate(lens)]).to(DEVICE)
    layout = PagedLayout(torch.arange(seqs + 1, dtype=torch.int32).to(DEVICE),
                         torch.tensor(lens, dtype=torch.int32).to(DEVICE), table.to(DEVICE), page, 1)
    outputs = {}
    for run in ("two ops", mode):
        caches = [torch.full((3, page, kv_heads, head_dim), 0.5, device=DEVICE) for _ in range(2)]
        context = layers.PagedContext(layout, slots, [tuple(caches)])
        calls = []
        original = layers.rotary_cache_write
        monkeypatch.setattr(layers, "rotary_cache_write", lambda *a, **kw: calls.append(1) or original(*a, **kw))
        with torch.no_grad(), use_decode_rotary("off" if run == "two ops" else mode):
            out = context.attend_rotary(0, q, k, v, positions, (cos, sin), head_dim ** -0.5, *norms)
        monkeypatch.setattr(layers, "rotary_cache_write", original)
        outputs[run] = (out, caches, len(calls))
    (want, want_caches, two_op_calls), (got, got_caches, calls) = outputs["two ops"], outputs[mode]
    assert two_op_calls == 1 and calls == (0 if mode == "on" else 1)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))
