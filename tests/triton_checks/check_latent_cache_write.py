"""`latent_cache_write`'s kernel against the separate ops it replaces in rollouts (`rms_norm` of
the latent, `apply_rotary` of the de-interleaved rope parts, the concatenations,
`kv_cache_write`), bitwise: under TRITON_INTERPRET=1 on CPU (its logic) and on a GPU (where the
norm's row sums must also follow the norm kernel's order)."""

import importlib
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels import latent_cache_write, rope_table  # noqa: E402
from vexact_models.kernels.latent_cache_write import latent_cache_write_reference  # noqa: E402

lcw = importlib.import_module("vexact_models.kernels.latent_cache_write")  # the module (the package names the op)
DTYPES = [torch.float32] if INTERPRET else [torch.bfloat16, torch.float32]


def _inputs(tokens, heads, rank, rope, nope, dtype, seed):
    """(The shapes give the projection rows a width of a multiple of 16 and kv's rows a 16-byte
    start in bf16 and fp32, as the real models' are: the kernel takes only such rows.)"""
    g = torch.Generator().manual_seed(seed)
    # one projection's output split into views, as the model's q_proj and kv_a_proj_with_mqa rows are
    proj = (torch.randn(tokens, heads * (nope + rope) + rank + rope, generator=g) * 3).to(dtype).to(DEVICE)
    q, kv = proj.split([heads * (nope + rope), rank + rope], dim=1)
    q_pe = q.view(tokens, heads, nope + rope)[..., nope:]
    q_latent = torch.randn(tokens, heads, rank, generator=g).to(dtype).to(DEVICE)
    positions = torch.randint(0, 4000, (tokens,), generator=g).to(DEVICE)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rope, 2).float() / rope))
    cos, sin = (t.to(DEVICE) for t in rope_table(inv_freq, 4096))
    weight = (1 + 0.1 * torch.randn(rank, generator=g)).to(dtype).to(DEVICE)
    slots = torch.randperm(3 * tokens, generator=g)[:tokens]
    slots[::5] = -1  # padding tokens of a captured graph write nothing
    return q_latent, q_pe, kv, positions, cos, sin, weight, slots.to(DEVICE)


def _cache(tokens, width, dtype):
    # [pages, page_size, 1, rank + rope], with a sentinel that unwritten rows must keep
    return torch.full((3 * tokens // 4 + 1, 4, 1, width), 7.0, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("tokens, heads, rank, rope, nope", [(1, 16, 512, 64, 128), (7, 4, 64, 16, 32),
                                                               (70, 2, 32, 8, 20), (20, 3, 16, 8, 16)])
def test_latent_cache_write_is_the_separate_ops(tokens, heads, rank, rope, nope, interleaved, dtype, monkeypatch):
    q_latent, q_pe, kv, positions, cos, sin, weight, slots = _inputs(tokens, heads, rank, rope, nope, dtype,
                                                                     tokens + heads)
    want_cache, got_cache = _cache(tokens, rank + rope, dtype), _cache(tokens, rank + rope, dtype)
    want = latent_cache_write_reference(q_latent, q_pe, kv, positions, cos, sin, weight, 1e-6, want_cache, slots,
                                        interleaved)
    def composition(*args):
        raise AssertionError("latent_cache_write ran the separate ops, not its kernel")

    monkeypatch.setattr(lcw, "latent_cache_write_reference", composition)
    got = latent_cache_write(q_latent, q_pe, kv, positions, cos, sin, weight, 1e-6, got_cache, slots, interleaved)
    assert torch.equal(got, want)
    assert torch.equal(got_cache, want_cache)
    assert (got_cache == 7.0).any()  # rows of padding tokens and unused slots kept the sentinel
