"""`kernels.gated_delta_step`'s plans (the fixed-shape arrays a CUDA graph replays) and its steps on
the reference backend: the arrays' values at a capacity past the step, the dry run's, the errors,
and steps over pooled states bitwise the training forward. The Triton kernel's steps:
tests/triton_checks/check_gated_delta_step.py; the engine's buffers: tests/runtime."""

import numpy as np
import pytest
import torch

from vexact_models.kernels.gated_delta_rule import gated_delta_rule
from vexact_models.kernels.gated_delta_step import StepPlan, dry_run, gated_delta_step, plan_sizes, plan_step

HK, HV, DK, DV = 1, 2, 16, 16


def rows(t, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(t, HV, DV, generator=gen)
    return [q, k, v, -torch.rand(t, HV, generator=gen) * 0.6 - 0.01, torch.rand(t, HV, generator=gen) * 0.9 + 0.05]


def staged(arrays):
    return StepPlan({name: torch.from_numpy(a) for name, a in arrays.items()})


def test_plan_of_a_step():
    """Pool of 4 slots: a decode token (slot 2, position 31), a prompt piece (slot 0, from position
    5), a prompt from position 0 (slot 3: no state read) and a paused sequence (slot 1, 0 tokens),
    at capacity 64 tokens, 6 sequences (padding entries: no rows, no state read or written)."""
    plan = plan_step([2, 0, 3, 1], [31, 5, 0, 9], [1, 40, 16, 0], 4, 64, 6)
    assert {k: (a.dtype, a.shape) for k, a in plan.items()} == plan_sizes(64, 6)
    assert all(a.dtype == np.int32 for a in plan.values())
    assert plan["slot"].tolist() == [2, 0, 3, 1, -1, -1] and plan["context"].tolist() == [31, 5, 0, 9, 0, 0]
    q_start, count, state_in, state_out = plan["segment"].tolist()
    assert q_start == [0, 1, 41, 57, 0, 0] and count == [1, 40, 16, 0, 0, 0]
    assert state_in == [2, 0, -1, 1, -1, -1] and state_out == [2, 0, 3, 1, -1, -1]
    assert staged(plan).segments().count.tolist() == count  # `RecurrentPlan`'s fields in order
    empty = plan_step([], [], [], 4, 8, 3)
    assert empty["slot"].tolist() == [-1] * 3 and empty["segment"].tolist() == [[0] * 3, [0] * 3, [-1] * 3, [-1] * 3]


def test_dry_run_writes_only_the_padding_state():
    """The dry run reads what the step reads (rows, counts, states in) and sends every state write
    of an entry with tokens to the padding state ``states[4]``; no conv slot; the plan is kept."""
    plan = plan_step([2, 0, 3, 1], [31, 5, 0, 9], [1, 40, 16, 0], 4, 64, 6)
    kept = {k: a.copy() for k, a in plan.items()}
    dry = dry_run(plan, 4)
    assert (dry["slot"] == -1).all() and np.array_equal(dry["context"], plan["context"])
    assert np.array_equal(dry["segment"][:3], plan["segment"][:3])
    assert dry["segment"][3].tolist() == [4, 4, 4, -1, -1, -1]
    assert all(np.array_equal(kept[k], plan[k]) for k in plan)
    assert {k: (a.dtype, a.shape) for k, a in dry.items()} == plan_sizes(64, 6)


@pytest.mark.parametrize("seed", range(6))
def test_any_step_fits_its_capacity(seed):
    """Random steps: one entry per sequence, rows back to back from 0, the rest padding."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    counts = rng.integers(0, 70, n)
    starts = rng.integers(0, 3, n) * rng.integers(1, 200, n)
    slots = rng.permutation(12)[:n]
    seqs = n + int(rng.integers(0, 3))
    plan = plan_step(slots, starts, counts, 12, int(counts.sum()), seqs)
    q_start, count, state_in, state_out = plan["segment"]
    assert q_start[:n].tolist() == np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    assert count[:n].tolist() == counts.tolist() and (count[n:] == 0).all()
    assert state_in[:n].tolist() == np.where(starts == 0, -1, slots).tolist() and (state_in[n:] == -1).all()
    assert state_out[:n].tolist() == slots.tolist() and (state_out[n:] == -1).all()


def test_plan_errors_name_the_limit():
    with pytest.raises(ValueError, match=r"2 sequences of \[3, 2\] tokens do not fit a step of 2 sequences and 4"):
        plan_step([0, 1], [0, 0], [3, 2], 2, 4, 2)
    with pytest.raises(ValueError, match=r"do not fit a step of 1 sequences"):
        plan_step([0, 1], [0, 0], [1, 1], 2, 4, 1)
    with pytest.raises(ValueError, match=r"\[1, -1\] tokens do not fit"):
        plan_step([0, 1], [0, 0], [1, -1], 2, 4, 2)
    with pytest.raises(ValueError, match=r"slots \[0, 2\] must lie in \[0, 2\)"):
        plan_step([0, 2], [0, 0], [1, 1], 2, 4, 2)
    with pytest.raises(ValueError, match=r"slots \[-1\] must lie in \[0, 2\)"):
        plan_step([-1], [0], [1], 2, 4, 2)
    with pytest.raises(ValueError, match=r"slots \[1, 1\] must be distinct"):
        plan_step([1, 1], [0, 0], [1, 1], 2, 4, 2)


def test_reference_steps_equal_training_bitwise():
    """Three sequences in slots 2, 0 and 0 again (the third reuses the first's slot once it is
    done, from position 0), prompt pieces, a pause and decode tokens, each step padded (NaN rows,
    padding entries) with its dry run first: the training forward's rows and final states, bitwise;
    the dry runs leave the slots' bits."""
    pieces = [[6, 1, 1], [3, 9, 0, 1], [0, 0, 0, 7, 1]]
    slot = [2, 0, 2]
    lengths = [sum(p) for p in pieces]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    inputs = rows(int(offsets[-1]))
    want, want_final = gated_delta_rule(*inputs, offsets.tolist(), output_final_state=True)
    pool = torch.full((4, HV, DK, DV), float("nan"))
    got, done = torch.full_like(want, float("nan")), [0, 0, 0]
    for step in range(5):
        order = [s for s in (2, 1, 0) if step < len(pieces[s]) and (pieces[s][step] or s == 1)]
        counts = [pieces[s][step] for s in order]
        index = torch.cat([torch.arange(offsets[s] + done[s], offsets[s] + done[s] + m) for s, m in zip(order, counts)])
        plan = plan_step([slot[s] for s in order], [done[s] for s in order], counts, 3, len(index) + 2, len(order) + 1)
        pad = [torch.cat([x[index], torch.full((2, *x.shape[1:]), float("nan"))]) for x in inputs]
        before = pool.clone()
        gated_delta_step(*pad, pool, staged(dry_run(plan, 3)))
        assert torch.equal(pool[:3].view(torch.int32), before[:3].view(torch.int32)), step
        got[index] = gated_delta_step(*pad, pool, staged(plan))[:len(index)]
        for s, m in zip(order, counts):
            done[s] += m
        if step == 2:
            assert torch.equal(pool[2], want_final[0])  # the first sequence's last state, before reuse
    assert done == lengths and torch.equal(got, want)
    assert torch.equal(pool[0], want_final[1]) and torch.equal(pool[2], want_final[2])


def test_step_rejects_bad_pool_states():
    inputs = rows(3)
    plan = staged(plan_step([0], [0], [3], 2, 3, 1))
    with pytest.raises(ValueError, match=r"pool_states \(3, 2, 16, 8\) torch.float32 must be torch.float32 "
                                         r"\[slots \+ 1, 2, 16, 16\]"):
        gated_delta_step(*inputs, torch.zeros(3, HV, DK, 8), plan)
    with pytest.raises(ValueError, match=r"torch.float64 must be torch.float32"):
        gated_delta_step(*inputs, torch.zeros(3, HV, DK, DV, dtype=torch.float64), plan)
