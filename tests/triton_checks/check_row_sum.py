"""`row_sum_halves` vs `row_sum_reference`, bitwise: under TRITON_INTERPRET=1 on CPU (the order
of the adds) and on a GPU, where it must also give the same bits for every tile shape and warp
count (which `tl.sum` does not promise)."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels.row_sum import row_sum_reference, row_sum_triton  # noqa: E402


@pytest.mark.parametrize("lane_sums", [False, True])
@pytest.mark.parametrize("width", [2, 16, 64])
@pytest.mark.parametrize("block_m, num_warps", [(16, 4), (64, 4), (128, 8), (16, 1)])
def test_row_sum_halves_is_the_reference_order(width, block_m, num_warps, lane_sums):
    g = torch.Generator().manual_seed(width)
    # magnitudes spread over many binades, so that another order rounds differently
    x = (torch.randn(77, width, generator=g) * torch.exp2(torch.randint(-20, 20, (77, width), generator=g).float()))
    x = x.to(DEVICE)
    got = row_sum_triton(x, block_m, num_warps, lane_sums)
    assert torch.equal(got, row_sum_reference(x))


def test_row_sum_triton_errors():
    with pytest.raises(ValueError, match="2-D float32"):
        row_sum_triton(torch.zeros(4, 8, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="width=24 must be a power of two"):
        row_sum_triton(torch.zeros(4, 24, device=DEVICE))
