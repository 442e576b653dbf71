import pytest
import torch

from vexact_models.kernels import gather_logprobs, log_softmax, token_logprobs, linear


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_log_softmax_matches_float64(temperature):
    x = torch.randn(9, 5000) * 3
    out = log_softmax(x, temperature)
    ref = torch.log_softmax(x.double() / temperature, -1)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, atol=2e-5)


def test_gather_equals_indexing_log_softmax_bitwise():
    x = torch.randn(33, 7000) * 5
    temps = torch.rand(33) + 0.3
    t = torch.randint(0, 7000, (33,))
    full = log_softmax(x, temps)
    lp, lse = gather_logprobs(x, t, temps, return_lse=True)
    assert torch.equal(lp, full[torch.arange(33), t])
    assert torch.allclose(lse.double(), torch.logsumexp(x.double() / temps.double()[:, None], -1), atol=1e-5)


def test_log_softmax_rows_invariant_to_batch():
    x = torch.randn(20, 151_936 // 8)
    t = torch.randint(0, x.shape[1], (20,))
    single = torch.cat([gather_logprobs(x[i:i + 1], t[i:i + 1], 0.9) for i in range(20)])
    assert torch.equal(gather_logprobs(x, t, 0.9), single)
    assert torch.equal(log_softmax(x[:1], 0.9), log_softmax(x, 0.9)[:1])


def test_gather_of_several_targets_a_row_equals_one_at_a_time():
    """``[rows, k]`` targets: each column bitwise its one-target gather (the reference path;
    tests/triton_checks/check_triton_kernels.py has the kernel's)."""
    x = torch.randn(6, 3000) * 4
    temps = torch.rand(6) + 0.5
    t = torch.randint(0, 3000, (6, 5))
    lp = gather_logprobs(x, t, temps)
    assert lp.shape == (6, 5)
    for j in range(5):
        assert torch.equal(lp[:, j], gather_logprobs(x, t[:, j], temps))


@pytest.mark.parametrize("shape", [(5,), (6, 0), (6, 2, 1), ()])
def test_gather_refuses_targets_of_another_shape(shape):
    with pytest.raises(ValueError, match=r"targets must have shape \(6,\) or \(6, k\)"):
        gather_logprobs(torch.randn(6, 10), torch.zeros(shape, dtype=torch.long))


def test_log_softmax_rejects_bad_temperature():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        log_softmax(torch.randn(2, 5), 0.0)


def test_token_logprobs_equals_sampler_path_bitwise():
    """token_logprobs == gather_logprobs(linear(h, W, fp32)) row by row, any chunking."""
    h = torch.randn(50, 32).bfloat16()
    w = torch.randn(300, 32).bfloat16()
    t = torch.randint(0, 300, (50,))
    sampler = torch.cat([gather_logprobs(linear(h[i:i + 1], w, out_dtype=torch.float32), t[i:i + 1], 0.8)
                         for i in range(50)])
    for chunk in (1, 7, 64):
        assert torch.equal(token_logprobs(h, w, t, 0.8, chunk_tokens=chunk), sampler)


def test_token_logprobs_backward_matches_autograd():
    h = torch.randn(13, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 40, (13,))
    g = torch.randn(13, dtype=torch.float64)
    got = torch.autograd.grad(token_logprobs(h, w, t, 0.75, chunk_tokens=5), (h, w), g)
    ref = torch.log_softmax((h @ w.T) / 0.75, -1)[torch.arange(13), t]  # 0.75: exact in fp32
    want = torch.autograd.grad(ref, (h, w), g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10)


def test_token_logprobs_errors():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        token_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), 1.0, chunk_tokens=0)


def test_token_logprobs_backward_chunks():
    """The backward takes bigger chunks than the forward unless the caller bounds them, and the
    default-chunked gradient is the float64 autograd one."""
    from vexact_models.kernels.token_logprobs import BACKWARD_LOGITS_BYTES, backward_rows

    assert backward_rows(None, 512, 151_936) == BACKWARD_LOGITS_BYTES // (4 * 151_936) // 256 * 256 == 3328
    assert backward_rows(None, 512, 10 ** 7) == 512  # never below the forward's chunk
    assert backward_rows(64, 64, 151_936) == 64  # chunk_tokens bounds the backward too
    h = torch.randn(700, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 30, (700,))
    got = torch.autograd.grad(token_logprobs(h, w, t).sum(), (h, w))
    want = torch.autograd.grad(torch.log_softmax(h @ w.T, -1)[torch.arange(700), t].sum(), (h, w))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10)
