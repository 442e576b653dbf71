"""The scheduler's decode short-cut (``Scheduler._schedule_decodes``) decides exactly what the
general path decides: twin schedulers, one with the short-cut switched off, must take the same
steps (same chunks, pages, preemptions, shared pages) through random workloads."""

from itertools import zip_longest

import pytest

from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.sampling_params import SamplingParams
from vexact_models.runtime.scheduler import Scheduler
from vexact_models.runtime.sequence import Sequence

from .workload_support import make_scheduler, random_workload, run_steps


def snapshot(sched, out):
    bm = sched.block_manager
    key = lambda s: (s.request_id, s.sample_index)  # noqa: E731
    return ([(key(i.seq), i.num_new_tokens, i.samples, i.seq.num_computed_tokens, list(i.seq.block_table))
             for i in out.scheduled], [key(s) for s in out.preempted], [key(s) for s in out.errored],
            bm.num_free_blocks, bm.num_cached_blocks, bm.num_shared_hits)


@pytest.mark.parametrize("seed", range(60))
def test_decode_short_cut_takes_the_general_paths_decisions(seed):
    config, requests = random_workload(seed)
    fast, fast_seqs = make_scheduler(config, requests)
    slow, slow_seqs = make_scheduler(config, requests)
    slow._schedule_decodes = lambda seqs, scheduled: 0  # every sequence through the general path
    for out_fast, out_slow in zip_longest(run_steps(fast), run_steps(slow)):
        assert out_fast is not None and out_slow is not None, "one finished before the other"
        assert snapshot(fast, out_fast) == snapshot(slow, out_slow)
    assert not fast.has_unfinished() and not slow.has_unfinished()
    for a, b in zip(fast_seqs, slow_seqs):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)


def test_decode_short_cut_is_taken_and_stops_at_a_prefill():
    # A decodes while B's long prompt is prefilled over several steps behind it.
    config = dict(block_size=4, num_blocks=64, sharing=True, max_num_seqs=4, budget=8, max_model_len=256,
                  chunked=True)
    requests = [([7, 8, 9], SamplingParams(max_tokens=10)), (list(range(10, 40)), SamplingParams(max_tokens=3))]
    sched, (a, b) = make_scheduler(config, requests)
    calls = []
    real = sched._schedule_decodes

    def recording(seqs, scheduled):
        seqs = list(seqs)
        calls.append(([s.request_id for s in seqs], real(seqs, scheduled)))
        return calls[-1][1]

    sched._schedule_decodes = recording
    for _ in run_steps(sched):
        pass
    assert ([0, 1], 1) in calls  # A short-cut, then the loop stops at B's prefill chunk
    assert ([1], 0) in calls  # B's chunk: the general path
    assert a.num_output_tokens == 10 and b.num_output_tokens == 3


def test_decode_short_cut_keeps_the_budget_of_siblings_that_take_the_leaders_prompt_state():
    """share_prompt_state, a prompt of 5 in pages of 4: at its share point (4) the leader has one
    prompt token left, a decode; in that step its waiting sibling copies its state and computes
    its own last token, and the running request after the leader leaves it that token of the
    budget of 8, on the short-cut as on the general path."""

    def make():
        sched = Scheduler(BlockManager(64, 4, enable_prefix_sharing=False), max_num_seqs=8, max_num_batched_tokens=8,
                          max_model_len=64, eos_token_id=None, share_prompt_state=True)
        params = SamplingParams(n=2, max_tokens=3)
        for seq in (Sequence(0, 0, [5] * 5, params, seed=0), Sequence(0, 1, [5] * 5, params, seed=1),
                    Sequence(1, 0, [6] * 20, SamplingParams(max_tokens=3), seed=9)):
            sched.add(seq)
        return sched

    fast, slow = make(), make()
    slow._schedule_decodes = lambda seqs, scheduled: 0
    copies = []
    for out_fast, out_slow in zip_longest(run_steps(fast), run_steps(slow)):
        assert out_fast is not None and out_slow is not None, "one finished before the other"
        assert snapshot(fast, out_fast) == snapshot(slow, out_slow)
        copies += [(i.seq.sample_index, i.num_new_tokens) for i in out_fast.scheduled if i.state_from is not None]
    assert copies == [(1, 1)]  # the sibling computes only its last prompt token
