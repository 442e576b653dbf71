"""latent_cache_write on CPU: what it computes (against float64 formulas), its errors, when it runs
the separate ops, and how the latent MLA attention routes a rollout through it. The fused
kernel's bits against those ops: tests/triton_checks/check_latent_cache_write.py (interpreter in
CI, GPU) and conformance/kernel_invariance.py (``--only latent``)."""

import pytest
import torch

from vexact_models import deepseek_v3
from vexact_models.deepseek_v3 import latent_attention as latent_module
from vexact_models.deepseek_v3.modeling import DeepseekV3Attention
from vexact_models.kernels import PagedLayout, latent_cache_write, rope_table
from vexact_models.layers import PackedContext, PagedContext

RANK, ROPE, HEADS = 16, 8, 3


def _inputs(tokens=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_latent = torch.randn(tokens, HEADS, RANK, generator=g)
    q_pe = torch.randn(tokens, HEADS, 2 * ROPE, generator=g)[..., ROPE:]  # a view, as the model's is
    kv = torch.randn(tokens, RANK + ROPE, generator=g)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, ROPE, 2).float() / ROPE))
    cos, sin = rope_table(inv_freq, 64)
    weight = 1 + 0.1 * torch.randn(RANK, generator=g)
    cache = torch.full((tokens + 2, 1, 1, RANK + ROPE), 7.0)
    slots = torch.arange(tokens) + 2
    slots[1] = -1
    return q_latent, q_pe, kv, positions, cos, sin, weight, cache, slots, inv_freq


def _rotate64(x, positions, inv_freq):
    angle = positions.double()[:, None, None] * inv_freq.double()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)


@pytest.mark.parametrize("interleaved", [True, False])
def test_latent_cache_write_assembles_queries_and_fills_the_cache(interleaved):
    q_latent, q_pe, kv, positions, cos, sin, weight, cache, slots, inv_freq = _inputs()
    got = latent_cache_write(q_latent, q_pe, kv, positions, cos, sin, weight, 1e-6, cache, slots, interleaved)

    def neox(x):  # DeepSeek's interleaved pairs (x0, x1), (x2, x3) ... -> halves [x0, x2, ...], [x1, x3, ...]
        return torch.cat([x[..., 0::2], x[..., 1::2]], -1) if interleaved else x

    latent = kv[:, :RANK].double()
    normed = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    k_rot = _rotate64(neox(kv[:, None, RANK:]), positions, inv_freq)[:, 0]
    assert got.shape == (6, HEADS, RANK + ROPE)
    assert torch.equal(got[..., :RANK], q_latent)
    assert torch.allclose(got[..., RANK:].double(), _rotate64(neox(q_pe), positions, inv_freq), rtol=1e-5, atol=1e-5)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            row = cache[slot, 0, 0].double()
            assert torch.allclose(row[:RANK], normed[token], rtol=1e-5, atol=1e-5)
            assert torch.allclose(row[RANK:], k_rot[token], rtol=1e-5, atol=1e-5)
    assert (cache[:2] == 7.0).all()  # slots nobody wrote: 0, 1 (token 1 is -1)


def test_latent_cache_write_errors():
    q_latent, q_pe, kv, positions, cos, sin, weight, cache, slots, _ = _inputs()
    args = (positions, cos, sin, weight, 1e-6, cache, slots)
    with pytest.raises(ValueError, match=r"q_latent and q_pe must be \[tokens, heads, dims\] and kv \[tokens, dims\]"):
        latent_cache_write(q_latent[0], q_pe, kv, *args)
    with pytest.raises(ValueError, match=r"q_latent is \(6, 3, 16\) but q_pe \(5, 3, 8\)"):
        latent_cache_write(q_latent, q_pe[:5], kv, *args)
    with pytest.raises(ValueError, match=r"slot_mapping \(5,\)"):
        latent_cache_write(q_latent, q_pe, kv, positions, cos, sin, weight, 1e-6, cache, slots[:5])
    with pytest.raises(ValueError, match="kv has 20 dims, not the latent's 16 plus the query's 8 rope dims"):
        latent_cache_write(q_latent, q_pe, kv[:, :20], *args)
    with pytest.raises(ValueError, match=r"norm_weight \(8,\) must be \(16,\)"):
        latent_cache_write(q_latent, q_pe, kv, positions, cos, sin, weight[:8], 1e-6, cache, slots)
    with pytest.raises(ValueError, match=r"the cache's rows \(1, 20\) \(torch.float32\) must be \(1, 24\)"):
        latent_cache_write(q_latent, q_pe, kv, positions, cos, sin, weight, 1e-6, cache[..., :20], slots)
    assert (cache == 7.0).all()  # nothing half-written


def test_latent_cache_write_keeps_gradients_through_the_separate_ops():
    q_latent, q_pe, kv, positions, cos, sin, weight, cache, slots, _ = _inputs()
    q_latent, q_pe = q_latent.requires_grad_(), q_pe.detach().requires_grad_()
    out = latent_cache_write(q_latent, q_pe, kv, positions, cos, sin, weight, 1e-6, cache, slots)
    g_latent, g_pe = torch.autograd.grad((out * torch.randn(out.shape)).sum(), [q_latent, q_pe])
    assert g_latent.shape == q_latent.shape and g_pe.shape == q_pe.shape and g_pe.abs().sum() > 0


def _attention_layer():
    config = deepseek_v3.tiny_config(mla_kv_cache="latent", kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    torch.manual_seed(0)
    attn = DeepseekV3Attention(config, 0)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return attn


def _paged(tokens, attn):
    layout = PagedLayout(cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
                         seq_lens=torch.tensor([tokens], dtype=torch.int32),
                         block_table=torch.arange(tokens, dtype=torch.int32)[None], page_size=1, max_seqlen_q=tokens)
    cache = torch.zeros(tokens, 1, 1, attn.kv_lora_rank + attn.rope_dim)
    return PagedContext(layout, torch.arange(tokens), [(cache, cache[..., :attn.kv_lora_rank])])


def test_rollout_latent_attention_runs_the_fused_op_and_equals_training(monkeypatch):
    """A paged context (a rollout) goes through `latent_cache_write` and attends over what it
    wrote; training's packed context runs the separate ops; the two agree. A hooked
    ``kv_a_layernorm`` keeps its module call (the hook runs) and the separate ops."""
    attn = _attention_layer()
    tokens = 7
    hidden = torch.randn(tokens, attn.config.hidden_size)
    positions = torch.arange(tokens)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, ROPE, 2).float() / ROPE))
    rope = rope_table(inv_freq, 64)
    calls = []
    fused = latent_module.latent_cache_write
    monkeypatch.setattr(latent_module, "latent_cache_write", lambda *a: calls.append("fused") or fused(*a))
    with torch.no_grad():
        packed = attn(hidden, positions, rope, PackedContext(torch.tensor([0, tokens]), tokens))
        assert calls == []
        context = _paged(tokens, attn)
        paged = attn(hidden, positions, rope, context)
        assert calls == ["fused"]
        assert torch.allclose(paged, packed, rtol=1e-5, atol=1e-5)
        assert context.kv_caches[0][0].abs().sum() > 0  # the fused op wrote the cache
        attn.kv_a_layernorm.register_forward_hook(lambda *args: calls.append("norm"))
        hooked = attn(hidden, positions, rope, _paged(tokens, attn))
    assert calls == ["fused", "norm"] and torch.equal(hooked, paged)
