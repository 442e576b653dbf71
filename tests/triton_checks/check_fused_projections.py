"""The fused rollout projections (`vexact_models.projections`) on the Triton linear kernel: one
GEMM over q/k/v weights and biases stacked in one buffer gives bitwise the outputs of the
separate GEMMs, including when the fused N picks another tile config; see check_triton_kernels."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

# pytest's importlib mode does not put this folder on sys.path; importing the shared helpers
# also applies their skip rule (conftest.py patches the interpreter's tl.dot)
sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, INTERPRET, close, ref

from vexact_models.kernels import linear
from vexact_models.kernels.linear import pick_config
from vexact_models.projections import fuse_linears, grouped_linear


# (q, k, v output widths, K, M): GQA q/k/v; a fused N (1280) whose bf16 decode tile (block_n 32)
# differs from the separate ones' (16); K and N not multiples of the tiles
CASES = [((64, 32, 32), 64, 1), ((64, 32, 32), 64, 70), ((1024, 128, 128), 64, 3), ((96, 40, 40), 130, 5)]
if not INTERPRET:  # on a GPU also the published groups: Qwen2.5-7B q/k/v (biased), Llama-3.1-8B q/k/v and gate/up
    CASES += [(widths, k, m) for widths, k in (((3584, 512, 512), 3584), ((4096, 1024, 1024), 4096),
                                               ((14336, 14336), 4096)) for m in (1, 7, 64, 300, 2048)]


@pytest.mark.parametrize("widths,k,m", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_biased_projections_equal_separate_bitwise(widths, k, m, dtype):
    gen = torch.Generator().manual_seed(m)
    group = [nn.Linear(k, n, bias=True).to(DEVICE, dtype) for n in widths]
    with torch.no_grad():
        for lin in group:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen) * 4)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    with torch.no_grad():
        separate = [linear(x, lin.weight, lin.bias) for lin in group]
        assert fuse_linears(group)
        fused = grouped_linear(x, group)
    for got, want, lin in zip(fused, separate, group):
        assert torch.equal(got, want)
        if m * lin.out_features * k <= 1 << 26:  # the CPU reference is slow at the published sizes
            close(want, ref(linear, x, lin.weight, lin.bias), 1e-2 if dtype == torch.bfloat16 else 1e-5)
    if widths[0] == 1024 and dtype == torch.bfloat16:  # the case is what it claims: two tile configs
        assert pick_config(m, sum(widths), k, dtype) != pick_config(m, widths[1], k, dtype)
