import pytest
import torch

from vexact_models.kernels import apply_rotary, rope_table


def _hf_rotate(x, pos, inv_freq):
    freqs = pos.double()[:, None] * inv_freq.double()[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x = x.double()
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def test_rope_table_shapes_and_values():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    cos, sin = rope_table(inv_freq, 100, scaling=2.0)
    assert cos.shape == (100, 8) and cos.dtype == torch.float32
    assert torch.allclose(cos[5], 2 * torch.cos(5 * inv_freq)) and torch.allclose(sin[0], torch.zeros(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotary_matches_hf_formula(dtype):
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 32, 2).float() / 32))
    cos, sin = rope_table(inv_freq, 512)
    x = torch.randn(20, 3, 32).to(dtype)
    pos = torch.randint(0, 512, (20,))
    out = apply_rotary(x, pos, cos, sin)
    assert torch.allclose(out.double(), _hf_rotate(x, pos, inv_freq), rtol=1e-5, atol=1e-4)


def test_rotary_backward_is_inverse_rotation():
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 8, 2).double() / 8))
    cos, sin = (t.double() for t in rope_table(inv_freq, 64))
    x = torch.randn(9, 2, 8, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 64, (9,))
    g = torch.randn(9, 2, 8, dtype=torch.float64)
    (got,) = torch.autograd.grad(apply_rotary(x, pos, cos, sin), x, g)
    c, s = cos[pos][:, None], sin[pos][:, None]
    xr = torch.cat([x[..., :4] * c - x[..., 4:] * s, x[..., 4:] * c + x[..., :4] * s], -1)
    (want,) = torch.autograd.grad(xr, x, g)
    assert torch.allclose(got, want, atol=1e-12)


def test_rotary_shape_errors():
    cos, sin = rope_table(torch.ones(9), 8)
    with pytest.raises(ValueError, match="table has 9 frequencies, head_dim 16 takes 1 to 8"):
        apply_rotary(torch.randn(2, 1, 16), torch.zeros(2, dtype=torch.long), cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_partial_rotary_matches_transformers(dtype):
    """Qwen3-Next / Qwen3.5: partial_rotary_factor 0.25 of head dim 256, the first 64 dims rotated
    as NeoX halves (HF's `apply_rotary_pos_emb` with a 64-wide cos/sin), the other 192 copied."""
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = rope_table(inv_freq, 300)
    q, k = torch.randn(7, 4, 256).to(dtype), torch.randn(7, 2, 256).to(dtype)
    pos = torch.randint(0, 300, (7,))
    freqs = pos[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    hf_q, hf_k = apply_rotary_pos_emb(q.double().transpose(0, 1), k.double().transpose(0, 1), emb.cos().double(),
                                      emb.sin().double(), unsqueeze_dim=0)
    for ours, hf in ((apply_rotary(q, pos, cos, sin), hf_q.transpose(0, 1)), (apply_rotary(k, pos, cos, sin),
                                                                              hf_k.transpose(0, 1))):
        assert ours.shape == hf.shape and ours.dtype == dtype
        tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
        assert torch.allclose(ours.double(), hf, rtol=tol, atol=tol)
    assert torch.equal(apply_rotary(q, pos, cos, sin)[..., 64:], q[..., 64:])  # the rest passes through exactly
    rows = torch.cat([apply_rotary(q[i:i + 1], pos[i:i + 1], cos, sin) for i in range(7)])
    assert torch.equal(rows, apply_rotary(q, pos, cos, sin))


def test_partial_rotary_backward():
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 4, 2).double() / 4))
    cos, sin = (t.double() for t in rope_table(inv_freq, 32))
    x = torch.randn(5, 2, 12, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 32, (5,))
    g = torch.randn(5, 2, 12, dtype=torch.float64)
    (got,) = torch.autograd.grad(apply_rotary(x, pos, cos, sin), x, g)
    c, s = cos[pos][:, None], sin[pos][:, None]
    xr = torch.cat([x[..., :2] * c - x[..., 2:4] * s, x[..., 2:4] * c + x[..., :2] * s, x[..., 4:]], -1)
    (want,) = torch.autograd.grad(xr, x, g)
    assert torch.allclose(got, want, atol=1e-12)
