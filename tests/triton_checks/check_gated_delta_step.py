"""A rollout step of the gated delta rule from a fixed-shape plan (`kernels.gated_delta_step`, what
a CUDA graph replays) on the Triton kernel: plans padded past the step (padding entries: programs
that exit at once; padding tokens: NaN), its dry run (writes only the padding state), slots reused
by a new sequence (stale state never read), prompt pieces, pauses and decode tokens, bitwise the
Triton training forward. Under TRITON_INTERPRET=1 on CPU and on a GPU (docs/design.md section 6b)."""

import os

import numpy as np
import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels import use_backend  # noqa: E402
from vexact_models.kernels.gated_delta_rule import gated_delta_rule  # noqa: E402
from vexact_models.kernels.gated_delta_step import StepPlan, dry_run, gated_delta_step, plan_step  # noqa: E402

HK, HV, DK, DV = 1, 2, 16, 16
POOL = 4  # slots; states[POOL] is the padding state


def _rows(t, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(t, HV, DV, generator=gen)
    g = -torch.rand(t, HV, generator=gen) * 0.6 - 0.01
    beta = torch.rand(t, HV, generator=gen) * 0.9 + 0.05
    return [x.to(DEVICE) for x in (q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype))]


def _bits(x):
    """`x`'s bit patterns (NaN compares equal to itself)."""
    return x.view(torch.int32)


def _staged(arrays):
    return StepPlan({name: torch.from_numpy(a).to(DEVICE) for name, a in arrays.items()})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_padded_steps_equal_training_bitwise(dtype):
    """Four sequences: A (slot 3), B (slot 0) and C (slot 1) in prompt pieces, pauses and decode
    tokens; once B is done, D reuses slot 0 from position 0 (B's state left there is never read).
    Each step's plan at a capacity past its sizes (3 NaN padding tokens, 2 padding entries), its dry
    run first: the dry run leaves every slot's bits and writes the padding state. Outputs and the
    slots' last states equal the training forward's, bitwise."""
    pieces = {"A": [5, 13, 1, 0, 1, 1], "B": [7, 0, 1, 2], "C": [6, 1, 0, 1, 9, 1], "D": [0, 0, 0, 0, 11, 1]}
    slot = {"A": 3, "B": 0, "C": 1, "D": 0}
    names = list(pieces)
    lengths = [sum(pieces[s]) for s in names]
    offsets = dict(zip(names, np.concatenate([[0], np.cumsum(lengths)]).tolist()))
    rows_all = _rows(sum(lengths), dtype, seed=0)
    with use_backend("triton"):
        want, want_final = gated_delta_rule(*rows_all, _cu(lengths), output_final_state=True)
        pool = torch.full((POOL + 1, HV, DK, DV), float("nan"), device=DEVICE)  # stale: never read
        got = torch.full_like(want, float("nan"))
        done = dict.fromkeys(names, 0)
        for step in range(6):
            turn = names[step % 4:] + names[:step % 4]  # a different order every step
            order = [s for s in turn[::-1 if step % 2 else 1] if step < len(pieces[s]) and pieces[s][step]]
            if step == 3:
                order.append("A")  # named with no tokens: a paused sequence in the batch
            counts = [pieces[s][step] if step < len(pieces[s]) else 0 for s in order]
            index = torch.cat([torch.arange(offsets[s] + done[s], offsets[s] + done[s] + m)
                               for s, m in zip(order, counts)]).to(DEVICE)
            n = len(index)
            plan = plan_step([slot[s] for s in order], [done[s] for s in order], counts, POOL, n + 3, len(order) + 2)
            pad = [torch.cat([x[index], torch.full((3, *x.shape[1:]), float("nan"), dtype=x.dtype, device=DEVICE)])
                   for x in rows_all]
            before = pool.clone()
            dry = gated_delta_step(*pad, pool, _staged(dry_run(plan, POOL)))
            assert torch.equal(_bits(pool[:POOL]), _bits(before[:POOL])), step
            assert not torch.equal(_bits(pool[POOL]), _bits(before[POOL])), step
            out = gated_delta_step(*pad, pool, _staged(plan))
            assert torch.equal(dry[:n], out[:n]), step  # the dry run reads what the step reads
            got[index] = out[:n]
            for s, m in zip(order, counts):
                done[s] += m
            if step == 3:  # B is done: its slot's state is B's final state
                assert torch.equal(pool[slot["B"]], want_final[names.index("B")])
    assert done == dict(zip(names, lengths))
    assert torch.equal(got, want)
    for s in ("A", "C", "D"):
        assert torch.equal(pool[slot[s]], want_final[names.index(s)]), s


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def test_triton_step_with_stale_state_starts_from_zeros():
    """A sequence planned at position 0 in a slot that holds another sequence's state (here +inf)
    starts from zeros; one planned at a later position continues from its slot's state."""
    rows_all = _rows(9, torch.float32, seed=1)
    with use_backend("triton"):
        want, want_final = gated_delta_rule(*rows_all, output_final_state=True)
        pool = torch.full((POOL + 1, HV, DK, DV), float("inf"), device=DEVICE)
        first = gated_delta_step(*(x[:4] for x in rows_all), pool, _staged(plan_step([2], [0], [4], POOL, 4, 1)))
        rest = gated_delta_step(*(x[4:] for x in rows_all), pool, _staged(plan_step([2], [4], [5], POOL, 5, 1)))
    assert torch.equal(torch.cat([first, rest]), want)
    assert torch.equal(pool[2], want_final[0]) and torch.isinf(pool[[0, 1, 3, 4]]).all()
