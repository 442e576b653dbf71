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


@pytest.mark.parametrize("tile", [(1, 1), (16, 4)] if INTERPRET else [(1, 1), (4, 2), (16, 4), (64, 8)])
def test_rotary_cache_write_at_a_tile_is_the_separate_ops_at_that_tile(tile):
    """`benchmarks/investigations/row_kernels.py` times the kernel at other tiles: its normed rows then follow
    `rms_norm_triton` at the same tile, so the fused kernel still equals the separate ops."""
    from vexact_models.kernels import apply_rotary, kv_cache_write
    from vexact_models.kernels.rms_norm import rms_norm_triton

    dtype = DTYPES[-1]
    q, k, v, positions, cos, sin, (q_w, k_w), slots = _inputs(9, 16, 8, 128, dtype, 3)
    want_k, want_v = _caches(9, 8, 128, dtype)
    q_normed, k_normed = (rms_norm_triton(t, w, 1e-6, tile=tile)[0].view(t.shape) for t, w in ((q, q_w), (k, k_w)))
    want_q = apply_rotary(q_normed, positions, cos, sin)
    kv_cache_write(apply_rotary(k_normed, positions, cos, sin), v, want_k, want_v, slots)
    got_k, got_v = _caches(9, 8, 128, dtype)
    got_q = rotary_cache_write(q, k, v, positions, cos, sin, got_k, got_v, slots, q_w, k_w, 1e-6, tile=tile)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
def test_rotary_cache_write_qwen3_5_heads(norm, dtype):
    """Qwen3-Next / Qwen3.5 heads: head dim 256 with the first 64 dims rotated (partial rotary) and
    zero-centred q/k norms, bitwise the separate ops."""
    tokens, q_heads, kv_heads, head_dim = 6, 4, 2, 256
    q, k, v, positions, _, _, weights, slots = _inputs(tokens, q_heads, kv_heads, head_dim, dtype, 11)
    cos, sin = (t.to(DEVICE) for t in rope_table(1.0 / (1e4 ** (torch.arange(0, 64, 2).float() / 64)), 4096))
    norm_weights = [(w - 1).to(dtype) for w in weights] if norm else [None, None]  # offsets from 1
    want_k, want_v = _caches(tokens, kv_heads, head_dim, dtype)
    want_q = rotary_cache_write_reference(q, k, v, positions, cos, sin, want_k, want_v, slots, *norm_weights, 1e-6,
                                          zero_centred=True)
    got_k, got_v = _caches(tokens, kv_heads, head_dim, dtype)
    got_q = rotary_cache_write(q, k, v, positions, cos, sin, got_k, got_v, slots, *norm_weights, 1e-6,
                               zero_centred=True)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v, want_v)
    if norm:  # the option reached the kernel: the plain norm gives other values
        plain_k, plain_v = _caches(tokens, kv_heads, head_dim, dtype)
        plain = rotary_cache_write(q, k, v, positions, cos, sin, plain_k, plain_v, slots, *norm_weights, 1e-6)
        assert not torch.equal(plain, got_q)
    else:
        assert torch.equal(got_q[..., 64:], q[..., 64:])  # the unrotated dims copied
