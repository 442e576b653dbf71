"""BlockTables (the host mirror of the block tables) and the BlockManager keeping it in step
with the ``block_table`` lists; ``BlockManager.append_block`` against ``allocate``."""

import numpy as np
import pytest

from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.block_tables import BlockTables
from vexact_models.runtime.sampling_params import SamplingParams
from vexact_models.runtime.sequence import Sequence

from .workload_support import make_scheduler, random_workload, run_steps


class Seq:
    def __init__(self, seq_id):
        self.seq_id = seq_id


def test_rows_are_assigned_on_first_page_and_reused_lowest_first():
    tables = BlockTables(rows=4, width=2)
    tables.extend(7, 0, [])  # nothing to write: no row
    assert 7 not in tables and len(tables) == 0
    tables.extend(7, 0, [5, 6])
    tables.extend(9, 0, [1])
    assert tables.row(7) == 0 and tables.row(9) == 1
    assert tables.table(7) == [5, 6] and tables.table(9) == [1] and tables.table(3) == []
    tables.release(7)
    tables.release(7)  # a no-op the second time
    tables.extend(11, 0, [4])
    assert tables.row(11) == 0 and tables.table(11) == [4]
    with pytest.raises(KeyError):
        tables.row(7)


def test_both_dimensions_grow_and_rows_stay_zero_padded():
    tables = BlockTables(rows=1, width=1)
    tables.extend(0, 0, [3])
    tables.extend(0, 1, [4, 5, 6])  # wider than the array
    tables.extend(1, 0, [8])  # more rows than the array
    assert tables.array.shape[0] >= 2 and tables.array.shape[1] >= 4
    assert tables.table(0) == [3, 4, 5, 6] and tables.table(1) == [8]
    rows = tables.rows([Seq(1), Seq(0)])
    assert rows.dtype == np.int64 and rows.tolist() == [1, 0]
    assert tables.gather(rows, 4).tolist() == [[8, 0, 0, 0], [3, 4, 5, 6]]
    assert tables.gather(rows, 9).shape == (2, 9)  # wider than ever written: zeros
    tables.release(0)
    tables.extend(2, 0, [7])  # reuses row 0: the old entries must not show
    assert tables.gather(tables.rows([Seq(2)]), 4).tolist() == [[7, 0, 0, 0]]
    with pytest.raises(KeyError):
        tables.rows([Seq(0)])
    with pytest.raises(ValueError):
        BlockTables(rows=0)


@pytest.mark.parametrize("seed", range(40))
def test_block_manager_mirror_matches_the_lists_through_random_workloads(seed):
    config, requests = random_workload(seed)
    sched, seqs = make_scheduler(config, requests)
    tables = sched.block_manager.tables
    for _ in run_steps(sched):
        for seq in seqs:
            assert tables.table(seq.seq_id) == seq.block_table
            if seq.block_table:
                row = tables.row(seq.seq_id)
                assert not tables.array[row, len(seq.block_table):].any()
    assert len(tables) == 0


def test_append_block_is_allocate_of_one_more_position():
    twins = [BlockManager(6, 4), BlockManager(6, 4)]
    seqs = []
    for bm in twins:
        a = Sequence(0, 0, list(range(10, 19)), SamplingParams(), 0)
        bm.allocate(a, 8)
        bm.cache_full_blocks(a, 8)
        a.num_computed_tokens = 8
        other = Sequence(1, 0, [3], SamplingParams(), 0)
        bm.allocate(other, 1)
        bm.free(other)  # its page goes to the back of the free list
        seqs.append(a)
    twins[0].allocate(seqs[0], 9)
    twins[1].append_block(seqs[1])
    assert seqs[0].block_table == seqs[1].block_table == [0, 1, 3]
    assert twins[0].tables.table(seqs[0].seq_id) == twins[1].tables.table(seqs[1].seq_id) == [0, 1, 3]
    assert [twins[0].ref_count(b) for b in range(6)] == [twins[1].ref_count(b) for b in range(6)]
    assert twins[0].num_free_blocks == twins[1].num_free_blocks == 3


def test_append_block_without_a_free_page_raises():
    bm = BlockManager(1, 2)
    a = Sequence(0, 0, [3, 4, 5], SamplingParams(), 0)
    bm.allocate(a, 2)
    with pytest.raises(RuntimeError, match="none of 1 is free"):
        bm.append_block(a)
    assert a.block_table == [0] and bm.tables.table(a.seq_id) == [0]
