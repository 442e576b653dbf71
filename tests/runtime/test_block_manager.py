"""BlockManager: deterministic allocation, no half-allocation, exclusive ownership."""

import pytest

from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.sampling_params import SamplingParams
from vexact_models.runtime.sequence import Sequence


def make_seq(n_prompt: int = 1) -> Sequence:
    return Sequence(0, 0, list(range(1, n_prompt + 1)), SamplingParams(), 0)


@pytest.mark.parametrize(
    "num_blocks, block_size, message",
    [
        (0, 4, "num_blocks=0 is below the minimum 1"),
        (4, 0, "block_size=0 is below the minimum 1"),
        (4.0, 4, "num_blocks=4.0 must be an int"),
        (4, True, "block_size=True must be an int"),
    ],
)
def test_constructor_validation(num_blocks, block_size, message):
    with pytest.raises(ValueError) as info:
        BlockManager(num_blocks, block_size)
    assert message in str(info.value)


def test_blocks_for_is_ceil():
    bm = BlockManager(8, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_table_in_free_list_order():
    bm = BlockManager(6, 4)
    a, b = make_seq(), make_seq()
    bm.allocate(a, 5)
    assert a.block_table == [0, 1] and bm.num_free_blocks == 4
    bm.allocate(b, 1)
    bm.allocate(a, 8)  # already covered: no new block
    assert a.block_table == [0, 1]
    bm.allocate(a, 9)
    assert a.block_table == [0, 1, 3] and b.block_table == [2]
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 5
    # Freed blocks go to the back of the free list, last page first (so a cached prefix loses
    # its tail first): the never-used 4, 5 come first, then a's 3, 1, 0.
    c = make_seq()
    bm.allocate(c, 16)
    assert c.block_table == [4, 5, 3, 1]


def test_can_allocate_counts_blocks_already_owned():
    bm = BlockManager(3, 2)
    a, b = make_seq(), make_seq()
    bm.allocate(a, 4)  # 2 blocks, 1 free
    assert bm.can_allocate(a, 6)  # needs 1 more
    assert not bm.can_allocate(a, 7)  # needs 2 more
    assert bm.can_allocate(b, 2) and not bm.can_allocate(b, 3)


def test_failed_allocate_changes_nothing():
    bm = BlockManager(4, 2)
    a, b = make_seq(), make_seq()
    bm.allocate(a, 4)
    bm.allocate(b, 1)
    with pytest.raises(RuntimeError, match="needs 2 more blocks"):
        bm.allocate(b, 6)
    assert b.block_table == [2] and bm.num_free_blocks == 1
    bm.allocate(b, 4)  # the one free block is still there
    assert b.block_table == [2, 3] and bm.num_free_blocks == 0


def test_slot_maps_positions_through_the_table():
    bm = BlockManager(8, 4)
    filler, seq = make_seq(), make_seq()
    bm.allocate(filler, 8)  # blocks 0, 1
    bm.allocate(seq, 10)  # blocks 2, 3, 4
    assert [bm.slot(seq, p) for p in range(10)] == [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    bm.free(filler)
    bm.allocate(seq, 13)  # gets block 5 (next on the free list), not a freed one
    assert bm.slot(seq, 12) == 5 * 4 + 0
    with pytest.raises(IndexError):
        bm.slot(seq, 16)
    with pytest.raises(IndexError):
        bm.slot(seq, -1)


def test_double_free_is_detected():
    bm = BlockManager(2, 2)
    a = make_seq()
    bm.allocate(a, 3)
    stale = list(a.block_table)
    bm.free(a)
    a.block_table.extend(stale)
    with pytest.raises(RuntimeError, match="already free"):
        bm.free(a)
    assert bm.num_free_blocks == 2
