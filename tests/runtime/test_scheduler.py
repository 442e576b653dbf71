"""Scheduler policy: budgets, chunked prefill, mixing, preemption, errors, FIFO determinism.

A fake model drives the scheduler: the "sampled" token is a pure function of the sequence's
seed and current length, like the real counter-based sampler, so a sequence's outputs must not
depend on batching or preemption. Every step is checked against the scheduler's invariants.
"""

import pytest

from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.sampling_params import SamplingParams
from vexact_models.runtime.scheduler import Scheduler
from vexact_models.runtime.sequence import Sequence, SequenceStatus

EOS = 0


def fake_token(seq: Sequence) -> int:
    return 100 + (seq.seed * 7919 + seq.num_tokens * 104729) % 1000  # never EOS


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256,
                   chunked_prefill=True):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, EOS, chunked_prefill)


def make_seqs(prompt_lens, max_tokens=4):
    return [
        Sequence(r, 0, [10 + r] * n, SamplingParams(max_tokens=max_tokens), seed=r)
        for r, n in enumerate(prompt_lens)
    ]


def check_step(sched: Scheduler, out) -> None:
    bm = sched.block_manager
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs
    assert sched.num_running <= sched.max_num_seqs
    assert len({id(item.seq) for item in out.scheduled}) == len(out.scheduled)
    owned = []
    for item in out.scheduled:
        seq = item.seq
        end = seq.num_computed_tokens + item.num_new_tokens
        assert seq.status is SequenceStatus.RUNNING and item.num_new_tokens >= 1
        assert end <= seq.num_tokens and item.samples == (end == seq.num_tokens)
        assert len(seq.block_table) >= bm.blocks_for(end)
        if not sched.chunked_prefill:
            assert end == seq.num_tokens
    for seq in out.preempted:
        assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        assert seq.block_table == [] and seq not in [i.seq for i in out.scheduled]
    for item in out.scheduled:
        owned += item.seq.block_table
        assert len(item.seq.block_table) == len(set(item.seq.block_table))
    # a page listed by several sequences is a shared one: counted once per holder, and every
    # holder has computed it already, except possibly the one that writes it this step
    for block in set(owned):
        holders = [i for i in out.scheduled if block in i.seq.block_table]
        assert bm.ref_count(block) >= len(holders)
        if len(holders) > 1:
            ends = [i.seq.block_table.index(block) * bm.block_size + bm.block_size for i in holders]
            writing = [i for i, end in zip(holders, ends) if end > i.seq.num_computed_tokens]
            assert len(writing) <= 1


def drive(sched: Scheduler, seqs, max_steps=1000):
    """Run to completion; returns the trace of steps and the preempted sequences."""
    for seq in seqs:
        sched.add(seq)
    trace, preempted = [], []
    while sched.has_unfinished():
        assert len(trace) < max_steps, "scheduler made no progress"
        out = sched.schedule()
        check_step(sched, out)
        preempted += out.preempted
        trace.append([(i.seq.request_id, i.num_new_tokens, i.samples) for i in out.scheduled])
        tokens = [fake_token(i.seq) if i.samples else None for i in out.scheduled]
        logprobs = [-1.0 if i.samples else None for i in out.scheduled]
        sched.postprocess(out.scheduled, tokens, logprobs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return trace, preempted


def expected_outputs(seq: Sequence, max_tokens: int) -> list[int]:
    probe = Sequence(0, 0, seq.token_ids[: seq.num_prompt_tokens], seq.params, seq.seed)
    for _ in range(max_tokens):
        probe.append_token(fake_token(probe), 0.0)
    return probe.output_token_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs=0 is below the minimum 1"),
        ({"budget": 0}, "max_num_batched_tokens=0 is below the minimum 1"),
        ({"max_model_len": 0}, "max_model_len=0 is below the minimum 1"),
        ({"max_num_seqs": 2.5}, "max_num_seqs=2.5 must be an int"),
        ({"chunked_prefill": False, "budget": 16, "max_model_len": 32},
         "max_num_batched_tokens=16 is below the minimum max_model_len=32"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError) as info:
        make_scheduler(**kwargs)
    assert message in str(info.value)


def test_token_budget_is_respected_and_chunks_sum_to_prompt():
    sched = make_scheduler(budget=8)
    trace, _ = drive(sched, make_seqs([10, 10, 10], max_tokens=2))
    assert trace[0] == [(0, 8, False)]
    assert trace[1] == [(0, 2, True), (1, 6, False)]
    assert trace[2] == [(0, 1, True), (1, 4, True), (2, 3, False)]
    assert all(sum(n for _, n, _ in step) <= 8 for step in trace)
    for r in range(3):
        chunks = [(n, s) for step in trace for (rid, n, s) in step if rid == r]
        # prefill chunks add up to the prompt; only the last one samples; then one decode
        assert sum(n for n, _ in chunks[:-1]) == 10
        assert [s for n, s in chunks] == [False] * (len(chunks) - 2) + [True, True]


def test_long_prompt_is_chunked_in_budget_sized_pieces():
    sched = make_scheduler(budget=5)
    trace, _ = drive(sched, make_seqs([23], max_tokens=1))
    assert trace == [[(0, 5, False)]] * 4 + [[(0, 3, True)]]


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    trace, _ = drive(sched, make_seqs([3, 3, 3, 3, 3], max_tokens=3))
    assert trace[0] == [(0, 3, True), (1, 3, True)]
    assert all(len(step) <= 2 for step in trace)
    # request 2 is admitted only once 0 and 1 have finished (3 outputs: steps 0..2)
    assert trace[3] == [(2, 3, True), (3, 3, True)]


def test_decode_and_prefill_share_a_step():
    sched = make_scheduler(budget=10)
    trace, _ = drive(sched, make_seqs([4, 20], max_tokens=3))
    assert trace[0] == [(0, 4, True), (1, 6, False)]
    assert trace[1] == [(0, 1, True), (1, 9, False)]
    assert trace[2] == [(0, 1, True), (1, 5, True)]


def test_no_chunking_when_disabled():
    sched = make_scheduler(budget=32, max_model_len=32, chunked_prefill=False)
    trace, _ = drive(sched, make_seqs([20, 20, 5], max_tokens=2))
    # 20 + 20 > 32: the second prompt waits whole (no 12-token chunk), and FIFO keeps the
    # third one (5 tokens, which would fit) behind it.
    assert trace[0] == [(0, 20, True)]
    assert trace[1] == [(0, 1, True), (1, 20, True), (2, 5, True)]


def test_waiting_queue_does_not_skip_ahead_when_blocks_are_short():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=100)
    # distinct prompts: b must not share a's pages (prefix sharing would make it fit)
    a = Sequence(0, 0, [1] * 8, SamplingParams(max_tokens=4), 0)  # 2 blocks now
    b = Sequence(1, 0, [2] * 12, SamplingParams(max_tokens=1), 1)  # 3 blocks now
    c = Sequence(2, 0, [3] * 2, SamplingParams(max_tokens=1), 2)  # 1 block would fit
    for seq in (a, b, c):
        sched.add(seq)
    out = sched.schedule()
    assert [i.seq for i in out.scheduled] == [a]
    assert sched.num_waiting == 2 and c.status is SequenceStatus.WAITING


def test_running_sequence_preempts_itself_when_it_arrived_last():
    sched = make_scheduler(num_blocks=5, block_size=1, max_num_seqs=2, budget=100)
    a, b, c = make_seqs([2, 2, 2], max_tokens=3)
    for seq in (a, b, c):
        sched.add(seq)
    out = sched.schedule()  # c waits: max_num_seqs=2
    assert [i.seq for i in out.scheduled] == [a, b]
    sched.postprocess(out.scheduled, [fake_token(i.seq) for i in out.scheduled], [0.0, 0.0])
    out = sched.schedule()  # a takes the last free block, so b has to give its blocks up
    assert [i.seq for i in out.scheduled] == [a] and out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_tokens == 3 and b.block_table == []  # its sampled token is kept
    sched.postprocess(out.scheduled, [fake_token(a)], [0.0])
    later = []
    while sched.has_unfinished():
        out = sched.schedule()
        check_step(sched, out)
        later += [i.seq for i in out.scheduled if i.seq is not a]
        toks = [fake_token(i.seq) if i.samples else None for i in out.scheduled]
        sched.postprocess(out.scheduled, toks, [0.0] * len(toks))
    # the preempted b went back to the FRONT of the queue: it resumes before c starts
    assert later[0] is b and later.index(c) > 0
    for seq in (a, b, c):
        assert seq.finish_reason == "length" and seq.output_token_ids == expected_outputs(seq, 3)


def test_preemption_under_a_tiny_cache_still_finishes_every_request():
    prompts, max_tokens = [3, 5, 2, 4, 3, 6], 7
    sched = make_scheduler(num_blocks=7, block_size=2, max_num_seqs=4, budget=6)
    seqs = make_seqs(prompts, max_tokens)
    _, preempted = drive(sched, seqs)
    assert preempted, "the cache was meant to be too small to avoid preemption"
    for seq in seqs:
        assert seq.is_finished and seq.finish_reason == "length"
        assert seq.num_output_tokens == max_tokens and len(seq.output_logprobs) == max_tokens
        # recompute after preemption continues the same sequence: same tokens as unbatched
        assert seq.output_token_ids == expected_outputs(seq, max_tokens)
    # every preempted sequence resumed and finished
    assert all(seq.is_finished for seq in preempted)


def test_never_fitting_request_errors_and_others_finish():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=16)
    ok1 = Sequence(0, 0, [1] * 6, SamplingParams(max_tokens=4), 0)
    too_big = Sequence(7, 0, [1] * 10, SamplingParams(max_tokens=10), 1)  # 20 positions
    ok2 = Sequence(2, 0, [1] * 3, SamplingParams(max_tokens=4), 2)
    sched.add(ok1)
    sched.add(too_big)
    assert too_big.is_finished and too_big.finish_reason == "error"
    assert "request 7" in too_big.error and "needs 5 KV cache blocks" in too_big.error
    assert "only 4 blocks in total" in too_big.error
    sched.add(ok2)
    out = sched.schedule()
    assert out.errored == [too_big] and too_big not in [i.seq for i in out.scheduled]
    errored_later = []
    while sched.has_unfinished():
        sched.postprocess(out.scheduled, [fake_token(i.seq) for i in out.scheduled],
                          [0.0] * len(out.scheduled))
        out = sched.schedule()
        errored_later += out.errored
    assert errored_later == []  # reported exactly once
    assert ok1.finish_reason == ok2.finish_reason == "length"
    assert ok1.num_output_tokens == ok2.num_output_tokens == 4
    assert too_big.num_output_tokens == 0


def test_a_step_that_could_never_progress_raises_naming_the_waiting_request():
    """Nothing running, nothing preempted, a sequence waiting and nothing scheduled: every later
    step would be the same, so schedule() raises instead of returning empty steps forever. Here a
    sequence outside the scheduler holds every page (a leak no scheduler path makes)."""
    sched = make_scheduler(num_blocks=4, block_size=4, budget=16)
    squatter = Sequence(9, 0, [1] * 16, SamplingParams(), 0)
    sched.block_manager.allocate(squatter, 16)
    too_big = Sequence(7, 0, [1] * 10, SamplingParams(max_tokens=10), 1)  # errored at add
    waiting = Sequence(3, 0, [1] * 6, SamplingParams(max_tokens=4), 2)
    sched.add(too_big)
    sched.add(waiting)
    with pytest.raises(RuntimeError, match=r"request 3 \(sample 0\) waits first in the queue and cannot be scheduled "
                       r"although no sequence runs \(0 of its 6 tokens computed, 0 more in the prefix cache; 0 of 4 KV "
                       r"cache blocks free, max_num_batched_tokens=16\)"):
        sched.schedule()
    sched.block_manager.free(squatter)
    out = sched.schedule()
    assert out.errored == [too_big] and [item.seq for item in out.scheduled] == [waiting]


def test_max_model_len_bounds_the_block_need_and_long_prompts_error():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    fits = Sequence(0, 0, [1] * 10, SamplingParams(max_tokens=10), 0)  # min(20, 16) = 4 blocks
    too_long = Sequence(1, 0, [1] * 16, SamplingParams(max_tokens=1), 1)
    sched.add(fits)
    sched.add(too_long)
    assert fits.status is SequenceStatus.WAITING
    assert too_long.finish_reason == "error" and "max_model_len=16" in too_long.error
    errored_only = make_scheduler(num_blocks=1, block_size=1)
    bad = make_seqs([5])[0]
    errored_only.add(bad)
    assert errored_only.has_unfinished()  # until its error has been reported
    out = errored_only.schedule()
    assert out.errored == [bad] and out.scheduled == [] and not errored_only.has_unfinished()


def test_same_inputs_give_the_same_schedule():
    def run():
        sched = make_scheduler(num_blocks=9, block_size=2, max_num_seqs=3, budget=7)
        seqs = make_seqs([5, 1, 8, 3, 6, 2, 4], max_tokens=5)
        trace, preempted = drive(sched, seqs)
        return trace, [s.request_id for s in preempted], [s.output_token_ids for s in seqs]

    first = run()
    assert first[1], "expected preemption in this workload"
    assert run() == first
    # FIFO: first admissions happen in request order
    admitted = []
    for step in first[0]:
        admitted += [rid for rid, _, _ in step if rid not in admitted]
    assert admitted == sorted(admitted)


def test_schedule_twice_without_postprocess_and_bad_postprocess_raise():
    sched = make_scheduler()
    sched.add(make_seqs([3])[0])
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="before postprocess"):
        sched.schedule()
    with pytest.raises(ValueError, match="1 scheduled sequences but 0 tokens"):
        sched.postprocess(out.scheduled, [], [])
    with pytest.raises(ValueError, match="samples but got no token"):
        sched.postprocess(out.scheduled, [None], [None])
    assert out.scheduled[0].seq.num_computed_tokens == 0  # bad calls changed nothing
    with pytest.raises(ValueError, match="already added"):
        sched.add(out.scheduled[0].seq)
