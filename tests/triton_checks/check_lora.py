"""`lora_add`'s Triton kernels (shrink partials, their ordered sum, the expand) against the
reference, under TRITON_INTERPRET=1 on CPU and on a GPU: close to the reference, and bitwise
what the contract promises of the kernels themselves (a row alone equals the row in a batch, a
stacked group equals its members' separate calls, in place equals out of place)."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels import lora_add, use_backend  # noqa: E402
from vexact_models.kernels.lora import CHUNK_K, lora_shrink_reference, lora_shrink_triton  # noqa: E402

SCALINGS = (2.0, 0.5, 1.5)
# fp32 adapter weights with bf16 activations (PEFT's default: A split into two bf16 halves in
# the shrink) and bf16 ones. triton 3.6's interpreter rounds an in-kernel fp32 -> bf16 cast
# otherwise than torch (the GPU's cvt.rn is torch's round-to-nearest-even): the halves differ
# there, their sum agrees within the tolerance
ADAPTER_DTYPES = [torch.bfloat16, torch.float32]


def operands(t, k, sizes, rank, dtype, adapter_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = (torch.randn(len(sizes) * rank, k, generator=g) / k ** 0.5).to(adapter_dtype)
    b = torch.randn(n, rank, generator=g).to(adapter_dtype)
    base = torch.randn(t, n, generator=g).to(dtype)
    return [v.to(DEVICE) for v in (base, x, a, b)]


@pytest.mark.parametrize("k", [64, 300, CHUNK_K, 2 * CHUNK_K + 70])
@pytest.mark.parametrize("dtype, adapter_dtype", [(torch.float32, torch.float32)]
                         + [(torch.bfloat16, d) for d in ADAPTER_DTYPES])
def test_shrink_is_close_to_the_reference_and_rows_are_alone(k, dtype, adapter_dtype):
    _, x, a, _ = operands(21, k, (40, 24), 8, dtype, adapter_dtype)
    u = lora_shrink_triton(x, a)
    want = lora_shrink_reference(x.cpu(), a.cpu())
    assert u.dtype == torch.float32 and u.shape == (21, 16)
    assert torch.allclose(u.cpu(), want, rtol=1e-4, atol=1e-4)
    for i in (0, 7, 20):
        assert torch.equal(lora_shrink_triton(x[i:i + 1], a), u[i:i + 1])


@pytest.mark.parametrize("sizes", [(40,), (48, 16, 16), (130, 70)])
@pytest.mark.parametrize("dtype, adapter_dtype", [(torch.float32, torch.float32)]
                         + [(torch.bfloat16, d) for d in ADAPTER_DTYPES])
def test_lora_add_matches_the_reference_and_stacked_equals_separate(sizes, dtype, adapter_dtype):
    base, x, a, b = operands(19, 200, sizes, 4, dtype, adapter_dtype)
    scalings = SCALINGS[:len(sizes)]
    bias = torch.randn(sum(sizes)).to(DEVICE)
    with use_backend("triton"):
        got = lora_add(base, x, a, b, scalings, bias=bias, sizes=sizes)
        col, parts = 0, []
        for g, (size, s) in enumerate(zip(sizes, scalings)):
            parts.append(lora_add(base[:, col:col + size], x, a[4 * g:4 * (g + 1)], b[col:col + size], (s,),
                                  bias=bias[col:col + size]))
            col += size
        alone = lora_add(base[5:6], x[5:6], a, b, scalings, bias=bias, sizes=sizes)
        inplace = base.clone()
        assert lora_add(inplace, x, a, b, scalings, bias=bias, sizes=sizes, inplace=True).data_ptr() == inplace.data_ptr()
    with use_backend("reference"):
        want = lora_add(base.cpu(), x.cpu(), a.cpu(), b.cpu(), scalings, bias=bias.cpu(), sizes=sizes)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.cpu().float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(torch.cat(parts, dim=1), got)
    assert torch.equal(alone, got[5:6]) and torch.equal(inplace, got)
