"""rotary_cache_write on CPU: what it computes (against float64 formulas), its errors, and when it
runs the separate ops. The fused kernel's bits against those ops: tests/triton_checks/
check_rotary_cache_write.py (interpreter in CI, GPU) and conformance/kernel_invariance.py."""

import pytest
import torch

from vexact_models.kernels import PagedLayout, rope_table, rotary_cache_write
from vexact_models.layers import PackedContext, PagedContext, RMSNorm


def _inputs(tokens=6, q_heads=4, kv_heads=2, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=g) for h in (q_heads, kv_heads, kv_heads))
    positions = torch.randint(0, 64, (tokens,), generator=g)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_table(inv_freq, 64)
    caches = [torch.full((tokens + 2, 1, kv_heads, head_dim), 7.0) for _ in range(2)]
    slots = torch.arange(tokens) + 2
    slots[1] = -1
    weights = [1 + 0.1 * torch.randn(head_dim, generator=g) for _ in range(2)]
    return q, k, v, positions, cos, sin, caches, slots, weights, inv_freq


def _rotate64(x, positions, inv_freq):
    angle = positions.double()[:, None, None] * inv_freq.double()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)


def _norm64(x, w, eps=1e-6):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("norm", [True, False])
def test_rotary_cache_write_rotates_queries_and_fills_the_cache(norm):
    q, k, v, positions, cos, sin, (k_cache, v_cache), slots, weights, inv_freq = _inputs()
    norm_weights = weights if norm else [None, None]
    got_q = rotary_cache_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots, *norm_weights)
    want_q = _rotate64(_norm64(q, weights[0]) if norm else q, positions, inv_freq)
    want_k = _rotate64(_norm64(k, weights[1]) if norm else k, positions, inv_freq)
    assert torch.allclose(got_q.double(), want_q, rtol=1e-5, atol=1e-5)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.allclose(k_cache[slot, 0].double(), want_k[token], rtol=1e-5, atol=1e-5)
            assert torch.equal(v_cache[slot, 0], v[token])
    assert (k_cache[:2] == 7.0).all() and (v_cache[:2] == 7.0).all()  # slots nobody wrote: 0, 1 (token 1 is -1)


def test_rotary_cache_write_errors():
    q, k, v, positions, cos, sin, (k_cache, v_cache), slots, (wq, wk), _ = _inputs()
    with pytest.raises(ValueError, match=r"q, k, v must be \[tokens, heads, head_dim\]"):
        rotary_cache_write(q[0], k, v, positions, cos, sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="q has 6 tokens but k 5"):
        rotary_cache_write(q, k[:5], v, positions, cos, sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match=r"slot_mapping \(5,\)"):
        rotary_cache_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots[:5])
    with pytest.raises(ValueError, match="pass both q_weight and k_weight"):
        rotary_cache_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots, wq)
    with pytest.raises(ValueError, match=r"norm weights \(8,\)/\(16,\) must be \(16,\)/\(16,\)"):
        rotary_cache_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots, wq[:8], wk)
    with pytest.raises(ValueError, match="do not match cache rows"):
        rotary_cache_write(q, k, v, positions, cos, sin, k_cache[..., :8], v_cache, slots)
    with pytest.raises(ValueError, match="tile rows=3 must be a power of two from 1 to 64"):
        rotary_cache_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots, tile=(3, 4))
    with pytest.raises(ValueError, match="rotary_cache_write: num_warps=16 must be 1, 2, 4 or 8"):
        rotary_cache_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots, tile=(4, 16))
    assert (k_cache == 7.0).all()  # nothing half-written


def test_rotary_cache_write_keeps_gradients_through_the_separate_ops():
    q, k, v, positions, cos, sin, (k_cache, v_cache), slots, (wq, wk), _ = _inputs()
    q = q.requires_grad_()
    out = rotary_cache_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots, wq, wk)
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert grad.shape == q.shape and grad.abs().sum() > 0


def _paged_context(slots, caches):
    tokens = slots.shape[0]
    layout = PagedLayout(cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
                         seq_lens=torch.tensor([tokens], dtype=torch.int32),
                         block_table=torch.arange(tokens + 2, dtype=torch.int32)[None], page_size=1, max_seqlen_q=tokens)
    return PagedContext(layout, torch.arange(tokens), [tuple(caches)])


def test_paged_attend_rotary_equals_the_packed_path_and_calls_hooked_norms():
    q, k, v, positions, cos, sin, caches, _, (wq, wk), _ = _inputs()
    q_norm, k_norm = RMSNorm(16), RMSNorm(16)
    with torch.no_grad():
        q_norm.weight.copy_(wq)
        k_norm.weight.copy_(wk)
    positions = torch.arange(6)
    packed = PackedContext(torch.tensor([0, 6]), 6).attend_rotary(0, q, k, v, positions, (cos, sin), 0.25, q_norm, k_norm)
    with torch.no_grad():
        paged = _paged_context(positions, caches).attend_rotary(0, q, k, v, positions, (cos, sin), 0.25, q_norm, k_norm)
    assert torch.allclose(paged, packed, rtol=1e-5, atol=1e-5)
    calls = []
    q_norm.register_forward_hook(lambda *args: calls.append("q"))
    with torch.no_grad():
        hooked = _paged_context(positions, caches).attend_rotary(0, q, k, v, positions, (cos, sin), 0.25, q_norm, k_norm)
    assert calls == ["q"] and torch.equal(hooked, paged)


def test_paged_attend_rotary_keeps_each_norms_epsilon():
    q, k, v, _, cos, sin, caches, _, _, _ = _inputs(seed=1)
    q_norm, k_norm = RMSNorm(16, eps=1e-6), RMSNorm(16, eps=0.5)  # one kernel takes one epsilon
    positions = torch.arange(6)
    packed = PackedContext(torch.tensor([0, 6]), 6).attend_rotary(0, q, k, v, positions, (cos, sin), 0.25, q_norm, k_norm)
    with torch.no_grad():
        paged = _paged_context(positions, caches).attend_rotary(0, q, k, v, positions, (cos, sin), 0.25, q_norm, k_norm)
    assert torch.allclose(paged, packed, rtol=1e-5, atol=1e-5)
