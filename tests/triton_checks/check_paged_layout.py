"""`page_slots`, the paged addressing every Triton attention kernel shares, against the layout's
definition (`slots_reference`): by shift and mask where the page size is a power of two, by
division elsewhere, with 32- and 64-bit slots; under TRITON_INTERPRET=1 on CPU and on a GPU."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels.paged_layout import page_slots_triton, slots_reference  # noqa: E402


@pytest.mark.parametrize("offsets_32", [True, False])
@pytest.mark.parametrize("page_size", [1, 16, 64, 24, 48])
def test_page_slots_are_the_layouts_slots(page_size, offsets_32):
    g = torch.Generator().manual_seed(page_size)
    pages = 9
    # three sequences' pages, shuffled over a pool of 40 (page ids far apart: wrong arithmetic shows)
    table = torch.randperm(40, generator=g)[:3 * pages].view(3, pages).to(torch.int32)
    n_keys = pages * page_size - page_size // 2  # a partly filled last page
    for seq in range(3):
        got = page_slots_triton(table.to(DEVICE), seq, n_keys, page_size, offsets_32)
        assert torch.equal(got.cpu(), slots_reference(table, seq, torch.arange(n_keys), page_size)), seq


def test_page_slots_triton_errors():
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="2-D int32"):
        page_slots_triton(table.long(), 0, 4, 16)
    with pytest.raises(ValueError, match=r"n_keys=65 must be in 1..64"):
        page_slots_triton(table, 0, 65, 16)
    with pytest.raises(ValueError, match=r"seq=2 must be in 0..1"):
        page_slots_triton(table, 2, 4, 16)
