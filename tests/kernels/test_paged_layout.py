"""The paged K/V layout and its addressing helpers (`kernels/paged_layout.py`); the kernels that
read it are checked in test_attention.py and tests/triton_checks."""

import torch

from vexact_models.kernels.paged_layout import offsets_fit_int32, packed_layout, page_shift, shuffled_block_table


def test_page_shift_is_log2_of_power_of_two_page_sizes_only():
    """The kernel finds a key's page by shift and mask only where the page size is 2 ** shift;
    other sizes (24, 48) keep the division (tests/triton_checks: both give the packed bits)."""
    assert [page_shift(n) for n in (1, 2, 16, 64, 256, 1 << 20)] == [0, 1, 4, 6, 8, 20]
    assert [page_shift(n) for n in (3, 24, 48, 96, 0)] == [None] * 5


def test_offsets_fit_int32_up_to_the_last_element_of_each_tensor():
    """Caches whose last element lies 2**31 - 1 elements past the first are addressed in 32 bits,
    one row more is not; a view counts by its own strides (a K split off a fused projection)."""
    rows = 2 ** 31 // 1024  # rows of 8 heads x 128 dims
    assert offsets_fit_int32(torch.empty(rows, 8, 128, device="meta"))
    assert not offsets_fit_int32(torch.empty(rows + 1, 8, 128, device="meta"))
    fused = torch.empty(rows // 3, 3 * 8 * 128, device="meta")
    assert offsets_fit_int32(fused[:, 1024:2048].view(rows // 3, 8, 128), torch.empty(0, 8, 128))
    assert not offsets_fit_int32(torch.empty(4, 8, 128), torch.empty(rows + 1, 8, 128, device="meta"))


def test_packed_layout_is_a_trivial_block_table():
    layout = packed_layout(torch.tensor([0, 3, 5], dtype=torch.int32), 3)
    assert layout.page_size == 1 and layout.seq_lens.tolist() == [3, 2]
    assert layout.block_table.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_shuffled_block_table_gives_each_sequence_its_own_pages():
    """ceil(len / page) pages a sequence, every page of the cache used once, rows padded with page
    0, the same table from the same generator seed (the checks' and benchmarks' tables)."""
    lens = [1, 64, 65, 300]
    table = shuffled_block_table(lens, 64, torch.Generator().manual_seed(3))
    assert table.dtype == torch.int32 and table.shape == (4, 5)
    used = [table[s, :-(-n // 64)].tolist() for s, n in enumerate(lens)]
    assert sorted(p for row in used for p in row) == list(range(1 + 1 + 2 + 5))
    assert table[0, 1:].eq(0).all() and table[2, 2:].eq(0).all()
    assert torch.equal(table, shuffled_block_table(lens, 64, torch.Generator().manual_seed(3)))
