"""Prefix sharing of full KV pages: BlockManager bookkeeping and the scheduler's use of it. The
engine end to end is in test_prefix_sharing_engine.py."""


import pytest

import vexact_models.runtime.block_manager as block_manager_module
from vexact_models.runtime import SamplingParams
from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.scheduler import Scheduler
from vexact_models.runtime.sequence import Sequence, SequenceStatus

BS = 4


def seq_of(tokens, request_id=0, sample_index=0, n=1, max_tokens=4):
    return Sequence(request_id, sample_index, list(tokens), SamplingParams(n=n, max_tokens=max_tokens), 0)


def computed(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Allocate ``seq`` up to ``num_tokens`` (default: all its tokens), as if its K/V were written
    now, and publish its full pages (what the scheduler does when it schedules a chunk)."""
    num_tokens = seq.num_tokens if num_tokens is None else num_tokens
    bm.allocate(seq, num_tokens)
    bm.cache_full_blocks(seq, num_tokens)
    seq.num_computed_tokens = num_tokens


PROMPT = list(range(10, 23))  # 13 tokens: 3 full pages, the last page holds 1 token


# -- BlockManager ---------------------------------------------------------------------------------

def test_full_pages_are_shared_with_reference_counts():
    bm = BlockManager(16, BS)
    a, b = seq_of(PROMPT), seq_of(PROMPT)
    computed(bm, a)
    assert a.block_table == [0, 1, 2, 3] and bm.num_cached_blocks == 3  # the partial page is not published
    assert bm.num_cached_tokens(b) == 12
    assert bm.can_allocate(b, 13)
    bm.allocate(b, 13)
    assert b.block_table == [0, 1, 2, 4] and b.num_computed_tokens == 12
    assert [bm.ref_count(x) for x in range(5)] == [2, 2, 2, 1, 1]
    assert bm.num_shared_hits == 3 and bm.num_free_blocks == 11
    # freeing: shared pages stay in use until their last holder lets go
    bm.free(a)
    assert [bm.ref_count(x) for x in range(5)] == [1, 1, 1, 0, 1] and bm.num_free_blocks == 12
    bm.free(b)
    assert [bm.ref_count(x) for x in range(5)] == [0] * 5 and bm.num_free_blocks == 16
    with pytest.raises(RuntimeError, match="already free"):
        b.block_table.extend([0, 1])
        bm.free(b)


def test_only_full_pages_before_the_last_token_are_shared():
    for n_tokens, shared in [(3, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)]:
        bm = BlockManager(16, BS)
        a, b = seq_of(PROMPT[:n_tokens]), seq_of(PROMPT[:n_tokens])
        computed(bm, a)
        assert bm.num_cached_blocks == n_tokens // BS
        # the page holding b's last token is never shared: that token needs its own logits
        assert bm.num_cached_tokens(b) == shared, n_tokens
        bm.allocate(b, n_tokens)
        assert b.num_computed_tokens == shared and len(b.block_table) == bm.blocks_for(n_tokens)
    # a longer sequence can take the page that holds a shorter one's last token
    bm = BlockManager(16, BS)
    computed(bm, seq_of(PROMPT[:8]))
    assert bm.num_cached_tokens(seq_of(PROMPT[:9])) == 8
    # allocate() takes shared pages only within the positions it is asked to cover
    c = seq_of(PROMPT[:9])
    bm.allocate(c, 5)
    assert c.num_computed_tokens == 4 and len(c.block_table) == 2
    assert bm.ref_count(c.block_table[1]) == 1  # fresh: its K/V are c's to write


def test_unpublished_pages_are_not_shared():
    bm = BlockManager(16, BS)
    a, b = seq_of(PROMPT), seq_of(PROMPT)
    bm.allocate(a, 13)  # allocated, nothing written yet
    assert bm.num_cached_tokens(b) == 0
    bm.cache_full_blocks(a, 6)  # a chunk [0, 6) is written: only page 0 is full
    assert bm.num_cached_blocks == 1 and bm.num_cached_tokens(b) == 4
    bm.cache_full_blocks(a, 6)  # idempotent
    assert bm.num_cached_blocks == 1
    bm.cache_full_blocks(a, 13)
    assert bm.num_cached_tokens(b) == 12


def test_sequence_must_be_at_its_table_end_to_share():
    bm = BlockManager(16, BS)
    computed(bm, seq_of(PROMPT))
    b = seq_of(PROMPT)
    bm.allocate(b, 2)  # a fresh page 0, not computed: b's table runs ahead of its computed prefix
    assert bm.num_cached_tokens(b) == 0
    bm.allocate(b, 13)
    assert b.num_computed_tokens == 0 and bm.num_shared_hits == 0


def test_running_sequence_shares_pages_past_ones_it_computed_itself():
    bm = BlockManager(16, BS)
    c, d = seq_of(PROMPT), seq_of(PROMPT)
    bm.allocate(c, 4)  # c is about to compute page 0 (block 0) ...
    computed(bm, d)  # ... while d computes everything (blocks 1..4)
    assert d.block_table == [1, 2, 3, 4] and bm.num_shared_hits == 0
    bm.cache_full_blocks(c, 4)  # c's page 0 is written: a duplicate of d's, which keeps serving
    c.num_computed_tokens = 4
    assert bm.num_cached_blocks == 3
    assert bm.num_cached_tokens(c) == 8  # the chain goes on from c's own page 0
    bm.allocate(c, 13)
    assert c.block_table == [0, 2, 3, 5] and c.num_computed_tokens == 12


def test_freed_pages_keep_their_key_until_reused():
    bm = BlockManager(6, BS)
    a = seq_of(PROMPT)
    computed(bm, a)  # pages 0..3
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    b = seq_of(PROMPT)
    assert bm.num_cached_tokens(b) == 12
    assert bm.can_allocate(b, 13)
    bm.allocate(b, 13)  # revives pages 0, 1, 2 from the free list, takes 4 fresh
    assert b.block_table == [0, 1, 2, 4] and b.num_computed_tokens == 12
    assert bm.num_free_blocks == 2 and bm.num_shared_hits == 3
    bm.free(b)
    # free order was last page first, behind the never-used 5 and a's 3: 5, 3, 4, 2, 1, 0.
    # Reusing pages drops their keys, the prefix tail first.
    filler = seq_of([7] * 13)
    bm.allocate(filler, 16)  # 5, 3, 4, 2
    assert filler.block_table == [5, 3, 4, 2]
    c = seq_of(PROMPT)
    assert bm.num_cached_tokens(c) == 8  # page 2 (PROMPT[8:12]) is gone, pages 0 and 1 are left
    bm.free(filler)
    bm.allocate(seq_of([8] * 24), 24)  # takes every page
    assert bm.num_cached_blocks == 0 and bm.num_cached_tokens(c) == 0


def test_revived_pages_count_against_the_free_list():
    bm = BlockManager(5, BS)
    a = seq_of(PROMPT)
    computed(bm, a)  # 4 pages, 1 free
    keep = seq_of(PROMPT)
    bm.allocate(keep, 4)  # shares page 0
    bm.free(a)  # pages 1, 2 cached but free, 3 free, page 0 still held by keep
    assert bm.num_free_blocks == 4
    b = seq_of(PROMPT)
    # b: page 0 shared in use (free of charge), pages 1, 2 revived, one fresh page: 3 from the list
    assert bm.can_allocate(b, 13)
    hog = seq_of([9] * 4)
    bm.allocate(hog, 4)  # the never-used page 4 is at the front
    hog2 = seq_of([9, 9])
    bm.allocate(hog2, 2)  # then page 3 (a's partial page, freed first)
    assert hog.block_table == [4] and hog2.block_table == [3] and bm.num_free_blocks == 2
    assert not bm.can_allocate(b, 13)
    with pytest.raises(RuntimeError, match="needs 3 more blocks"):
        bm.allocate(b, 13)
    assert b.block_table == [] and b.num_computed_tokens == 0 and bm.num_free_blocks == 2
    assert bm.can_allocate(b, 12) and bm.num_cached_tokens(b) == 12


@pytest.mark.parametrize("position", range(12))
def test_no_sharing_when_any_token_differs(position):
    bm = BlockManager(16, BS)
    computed(bm, seq_of(PROMPT))
    other = list(PROMPT)
    other[position] += 1000
    b = seq_of(other)
    # pages before the differing one are shared, none from it on
    assert bm.num_cached_tokens(b) == position // BS * BS
    bm.allocate(b, 13)
    assert b.num_computed_tokens == position // BS * BS


def test_same_page_tokens_at_another_prefix_are_not_shared():
    bm = BlockManager(16, BS)
    computed(bm, seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # page 1 has the same tokens but follows a different page 0: the chained key differs
    b = seq_of([0, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(b, 4)
    bm.cache_full_blocks(b, 4)
    b.num_computed_tokens = 4
    assert bm.num_cached_tokens(b) == 0


def test_key_collisions_are_caught_by_the_token_comparison(monkeypatch):
    monkeypatch.setattr(block_manager_module, "chain_key", lambda parent, tokens: b"same")
    bm = BlockManager(16, BS)
    computed(bm, seq_of([1, 2, 3, 4, 5]))
    assert bm.num_cached_tokens(seq_of([1, 2, 3, 9, 5])) == 0  # same key, other tokens
    b = seq_of([1, 2, 3, 4, 6])
    assert bm.num_cached_tokens(b) == 4
    bm.allocate(b, 5)
    assert b.num_computed_tokens == 4 and bm.num_shared_hits == 1


def test_disabled_sharing_never_shares():
    bm = BlockManager(16, BS, enable_prefix_sharing=False)
    a, b = seq_of(PROMPT), seq_of(PROMPT)
    computed(bm, a)
    assert bm.num_cached_blocks == 0 and bm.num_cached_tokens(b) == 0
    bm.allocate(b, 13)
    assert b.block_table == [4, 5, 6, 7] and b.num_computed_tokens == 0
    with pytest.raises(ValueError, match="enable_prefix_sharing=1 must be a bool"):
        BlockManager(4, 4, enable_prefix_sharing=1)


def test_reset_prefix_cache_forgets_every_key():
    bm = BlockManager(16, BS)
    a = seq_of(PROMPT)
    computed(bm, a)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_cached_tokens(seq_of(PROMPT)) == 0
    assert bm.num_free_blocks == 12  # owners are kept
    bm.free(a)
    assert bm.num_free_blocks == 16


# -- Scheduler (fake model) -----------------------------------------------------------------------

def fake_token(seq: Sequence) -> int:
    return 100 + (seq.seed * 7919 + seq.num_tokens * 104729) % 1000


def drive(sched: Scheduler, seqs):
    for seq in seqs:
        sched.add(seq)
    trace = []
    while sched.has_unfinished():
        out = sched.schedule()
        trace.append([(i.seq.sample_index, i.seq.num_computed_tokens, i.num_new_tokens) for i in out.scheduled])
        tokens = [fake_token(i.seq) if i.samples else None for i in out.scheduled]
        sched.postprocess(out.scheduled, tokens, [0.0 if t is not None else None for t in tokens])
        assert len(trace) < 1000
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return trace


def samples(prompt, n, max_tokens=5):
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return [Sequence(0, i, prompt, params, seed=i) for i in range(n)]


def test_samples_admitted_in_one_step_share_at_once():
    bm = BlockManager(64, BS)
    sched = Scheduler(bm, 8, 64, 256, 0)
    assert sched.enable_prefix_sharing
    seqs = samples(PROMPT, 4)
    trace = drive(sched, seqs)
    # sample 0 computes all 13 prompt tokens; 1..3 start at 12, after 3 shared pages
    assert trace[0] == [(0, 0, 13), (1, 12, 1), (2, 12, 1), (3, 12, 1)]
    assert bm.num_shared_hits == 9
    off = Scheduler(BlockManager(64, BS, enable_prefix_sharing=False), 8, 64, 256, 0)
    assert not off.enable_prefix_sharing
    twins = samples(PROMPT, 4)
    assert drive(off, twins)[0] == [(i, 0, 13) for i in range(4)]
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in twins]


def test_shared_tokens_cost_no_budget_under_chunked_prefill():
    bm = BlockManager(64, BS)
    sched = Scheduler(bm, 8, 4, 256, 0)
    trace = drive(sched, samples(PROMPT, 3, max_tokens=2))
    assert trace[:5] == [
        [(0, 0, 4)], [(0, 4, 4)], [(0, 8, 4)],
        [(0, 12, 1), (1, 12, 1), (2, 12, 1)],  # the samples join once the pages are written
        [(0, 13, 1), (1, 13, 1), (2, 13, 1)],
    ]
    # not the whole prompt: 2 requests with a common prefix, the second one's running chunks
    # pick up the pages the first one has written meanwhile
    bm = BlockManager(64, BS)
    sched = Scheduler(bm, 8, 6, 256, 0)
    a = Sequence(0, 0, PROMPT + [50, 51, 52], SamplingParams(max_tokens=1), 0)
    b = Sequence(1, 0, PROMPT + [60], SamplingParams(max_tokens=1), 1)
    trace = drive(sched, [a, b])
    assert bm.num_shared_hits > 0
    assert trace[0] == [(0, 0, 6)]


def test_preempted_sequence_shares_back_its_own_pages():
    bm = BlockManager(9, BS)
    sched = Scheduler(bm, 4, 64, 256, 0)
    a = Sequence(0, 0, list(range(10, 22)), SamplingParams(max_tokens=12), 0)  # 12 + 12 positions
    b = Sequence(1, 0, list(range(30, 39)), SamplingParams(max_tokens=12), 1)
    drive_preempted = []
    for seq in (a, b):
        sched.add(seq)
    while sched.has_unfinished():
        out = sched.schedule()
        drive_preempted += out.preempted
        for s in out.preempted:
            assert s.num_computed_tokens == 0 and s.block_table == [] and s.status is SequenceStatus.WAITING
        tokens = [fake_token(i.seq) if i.samples else None for i in out.scheduled]
        sched.postprocess(out.scheduled, tokens, [0.0 if t is not None else None for t in tokens])
    assert drive_preempted == [b]
    assert bm.num_shared_hits > 0  # b came back and took its still-cached pages
    assert bm.num_free_blocks == bm.num_blocks
    for seq in (a, b):
        probe = Sequence(0, 0, seq.token_ids[:seq.num_prompt_tokens], seq.params, seq.seed)
        for _ in range(12):
            probe.append_token(fake_token(probe), 0.0)
        assert seq.output_token_ids == probe.output_token_ids


def test_a_live_copy_of_a_prefix_serves_it_once_the_first_copy_is_reused():
    """A request scoring its prompt (prompt_logprobs) recomputes and publishes the pages another
    request computes in the same step; once the first copies are freed and reused, a third request
    shares the live copy instead of recomputing it."""
    bm = BlockManager(8, BS)
    sched = Scheduler(bm, 8, 64, 64, None)
    prompt = list(range(10, 19))  # 2 full pages before the last token

    def step():
        out = sched.schedule()
        tokens = [fake_token(i.seq) if i.samples else None for i in out.scheduled]
        tables = [list(i.seq.block_table) for i in out.scheduled]
        sched.postprocess(out.scheduled, tokens, [0.0 if t is not None else None for t in tokens])
        return tables

    first = Sequence(0, 0, prompt, SamplingParams(max_tokens=1), 0)
    scoring = Sequence(1, 0, prompt, SamplingParams(max_tokens=20, prompt_logprobs=1), 0)
    sched.add(first)
    sched.add(scoring)
    first_pages = step()[0][:2]
    assert first.is_finished and bm.num_shared_hits == 0 and first_pages != scoring.block_table[:2]
    keys = [bm.prefix.key(b) for b in scoring.block_table[:2]]
    assert [bm.prefix.key(b) for b in first_pages] == keys and None not in keys
    sched.add(Sequence(2, 0, list(range(100, 117)), SamplingParams(max_tokens=1), 0))  # takes every free page
    step()
    assert all(bm.prefix.key(b) not in keys for b in first_pages)  # reused by another prefix
    third = seq_of(prompt + [5], request_id=3)
    assert bm.num_cached_tokens(third) == 8
    bm.allocate(third, 10)
    assert third.block_table[:2] == scoring.block_table[:2] and third.num_computed_tokens == 8
