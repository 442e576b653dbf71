"""The rollout side of the gated delta rule (`GatedDeltaRollout`, the recurrent kernel a step at a
time): its bits equal training's in any split into steps and any batch, slots that add nothing or
start from a state, the errors; and (marked gpu) the same on the Triton kernel at Qwen3.5's heads."""

import pytest
import torch

from vexact_models.kernels.gated_delta_rollout import GatedDeltaRollout
from vexact_models.kernels.gated_delta_rule import gated_delta_rule

from .gated_delta_support import QWEN35_HEADS, cu, make_inputs, pieces_for, rollout_outputs

@pytest.mark.parametrize("hk,hv,dk,dv,initial,dtype", [(2, 2, 16, 16, False, torch.float32),
                                                       (1, 2, 16, 32, True, torch.float32),
                                                       (1, 1, 32, 16, True, torch.bfloat16),
                                                       (1, 2, 16, 16, True, torch.float64)])
def test_reference_rollout_equals_training_bitwise(hk, hv, dk, dv, initial, dtype):
    """Training (all sequences packed, one launch) against a rollout (prefill pieces of several
    sizes with pauses, then one token at a time, the other sequences in the same launches in a
    changing order): the same outputs and final states, bitwise."""
    lengths = [45, 35, 29, 70]
    inputs, state = make_inputs(lengths, hk, hv, dk, dv, dtype=dtype, initial=initial)
    if state is not None and dtype == torch.float64:
        state = state.double()
    want, want_final = gated_delta_rule(*inputs, cu(lengths), initial_state=state, output_final_state=True)
    pieces = pieces_for(lengths)
    assert all(0 in p for p in pieces[:2]) and max(max(p) for p in pieces) == 64  # pauses, a long piece
    got, roll = rollout_outputs(inputs, lengths, pieces, initial=state)
    assert got.dtype == want.dtype == dtype and roll.states.dtype == want_final.dtype
    assert torch.equal(got, want)
    assert torch.equal(roll.states, want_final)


def test_rollout_at_every_cut_of_a_sequence():
    """A sequence of 16 tokens cut once at every position (the prefix in one step, the rest in the
    next) and decoded token by token: each the training forward's rows and final state, bitwise;
    and the training forward itself resumed from a prefix's final state."""
    (q, k, v, g, beta), state = make_inputs([16], 1, 2, 16, 16)
    inputs = (q, k, v, g, beta)
    want, want_final = gated_delta_rule(*inputs, initial_state=state, output_final_state=True)
    for n in range(1, 16):
        got, roll = rollout_outputs(inputs, [16], [[n, 16 - n]], initial=state)
        assert torch.equal(got, want) and torch.equal(roll.states, want_final), n
        head, mid = gated_delta_rule(*(x[:n] for x in inputs), initial_state=state, output_final_state=True)
        tail, end = gated_delta_rule(*(x[n:] for x in inputs), initial_state=mid, output_final_state=True)
        assert torch.equal(torch.cat([head, tail]), want) and torch.equal(end, want_final), n
    got, roll = rollout_outputs(inputs, [16], [[1] * 16], initial=state)
    assert torch.equal(got, want) and torch.equal(roll.states, want_final)


def test_sequence_bits_do_not_depend_on_the_batch():
    """One sequence alone, packed first or last beside others, and beside itself: the same rows."""
    lengths = [23, 40, 9]
    inputs, _ = make_inputs(lengths, 1, 2, 16, 16, initial=False)
    offsets = cu(lengths)
    alone = [gated_delta_rule(*(x[offsets[s]:offsets[s + 1]] for x in inputs))[0] for s in range(3)]
    out, _ = gated_delta_rule(*inputs, offsets)
    assert all(torch.equal(out[offsets[s]:offsets[s + 1]], alone[s]) for s in range(3))
    order = [2, 0, 0, 1]
    rows = torch.cat([torch.arange(offsets[s], offsets[s + 1]) for s in order])
    out, _ = gated_delta_rule(*(x[rows] for x in inputs), cu([lengths[s] for s in order]))
    assert torch.equal(out, torch.cat([alone[s] for s in order]))


def test_empty_sequences_and_batch():
    (q, k, v, g, beta), state = make_inputs([5], 1, 1, 16, 16)
    alone, alone_final = gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, chunk_size=16)
    states = torch.cat([torch.ones_like(state), state, torch.ones_like(state)])
    out, final = gated_delta_rule(q, k, v, g, beta, [0, 0, 5, 5], initial_state=states, output_final_state=True,
                                  chunk_size=16)
    assert torch.equal(out, alone) and torch.equal(final[1], alone_final[0])
    assert torch.equal(final[0], states[0]) and torch.equal(final[2], states[2])  # no token: the initial state
    out, final = gated_delta_rule(q[:0], k[:0], v[:0], g[:0], beta[:0], output_final_state=True, chunk_size=16)
    assert out.shape == (0, 1, 16) and torch.equal(final, torch.zeros(1, 1, 16, 16))
    out, final = gated_delta_rule(q, k, v, g, beta, [0, 0, 5], output_final_state=True)
    assert torch.equal(final[0], torch.zeros(1, 16, 16)) and not torch.equal(final[1], final[0])


def test_rollout_steps_with_a_slot_adding_nothing():
    """A slot named with 0 tokens keeps its state (none yet, then the one it has)."""
    inputs, _ = make_inputs([30, 20], 1, 1, 16, 16, initial=False)
    want, want_final = gated_delta_rule(*inputs, [0, 30, 50], output_final_state=True, chunk_size=16)
    roll, got = GatedDeltaRollout(2, (1, 1), (16, 16)), torch.zeros_like(want)
    got[:0] = roll.step(*(x[:0] for x in inputs), [1, 0], [0, 0])
    assert roll.started == [False, False] and torch.equal(roll.states, torch.zeros(2, 1, 16, 16))
    for rows, slots, counts in (([*range(7), *range(30, 35)], [0, 1], [7, 5]), (list(range(7, 30)), [1, 0], [0, 23]),
                                (list(range(35, 50)), [0, 1], [0, 15])):
        got[rows] = roll.step(*(x[rows] for x in inputs), slots, counts)
    assert torch.equal(got, want) and roll.started == [True, True] and torch.equal(roll.states, want_final)


def test_rollout_from_an_initial_state_and_with_a_scale():
    """`initial_state` starts every slot from its state; `scale` and ``use_qk_l2norm=False`` are
    the training forward's."""
    inputs, state = make_inputs([12, 8], 1, 2, 16, 16)
    inputs[1] = torch.nn.functional.normalize(inputs[1], dim=-1) * 0.9
    for kwargs in (dict(), dict(scale=0.3, use_qk_l2norm=False)):
        want, want_final = gated_delta_rule(*inputs, [0, 12, 20], initial_state=state, output_final_state=True,
                                            **kwargs)
        roll = GatedDeltaRollout(2, (1, 2), (16, 16), initial_state=state, **kwargs)
        assert roll.started == [True, True]
        got = torch.cat([roll.step(*(x[:12] for x in inputs), [0], [12]), roll.step(*(x[12:] for x in inputs), [1], [8])])
        assert torch.equal(got, want) and torch.equal(roll.states, want_final)
    zero_start, _ = gated_delta_rule(*inputs, [0, 12, 20])
    assert not torch.equal(zero_start, want)


def test_rollout_errors():
    (q, k, v, g, beta), state = make_inputs([20], 2, 4, 16, 16)
    roll = GatedDeltaRollout(2, (2, 4), (16, 16))
    with pytest.raises(ValueError, match="slots=\\[0, 0\\] \\(distinct\\)"):
        roll.step(q, k, v, g, beta, [0, 0], [10, 10])
    with pytest.raises(ValueError, match="counts=\\[10, 9\\] must pair up and cover the 20 rows"):
        roll.step(q, k, v, g, beta, [0, 1], [10, 9])
    with pytest.raises(ValueError, match="slots=\\[0\\] .* counts=\\[10, 10\\] must pair up"):
        roll.step(q, k, v, g, beta, [0], [10, 10])
    with pytest.raises(ValueError, match="rows of torch.float64 need states of torch.float64, the rollout holds "
                                         "torch.float32"):
        roll.step(*(x.double() for x in (q, k, v, g, beta)), [0], [20])
    with pytest.raises(ValueError, match="initial_state \\(1, 4, 16, 16\\) must be \\(2, 4, 16, 16\\)"):
        GatedDeltaRollout(2, (2, 4), (16, 16), initial_state=state)
    with pytest.raises(ValueError, match="slots=\\[0, 2\\] must lie in \\[0, 2\\)"):
        roll.step(q, k, v, g, beta, [0, 2], [10, 10])
    with pytest.raises(ValueError, match="slots=\\[-1\\] must lie in"):
        roll.step(q, k, v, g, beta, [-1], [20])
    with pytest.raises(ValueError, match="must be \\[T, Hk, 16\\] and \\[T, 4, 16\\]"):
        roll.step(q, k, v[:, :2], g, beta, [0], [20])
    assert roll.started == [False, False] and torch.equal(roll.states, torch.zeros(2, 4, 16, 16))  # nothing ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("initial", [False, True])
def test_gpu_rollout_equals_training_bitwise(initial):
    lengths = [300, 64, 129, 77, 1]
    inputs, state = make_inputs(lengths, *QWEN35_HEADS, dtype=torch.bfloat16, device="cuda", initial=initial)
    want, want_final = gated_delta_rule(*inputs, cu(lengths), initial_state=state, output_final_state=True)
    pieces = pieces_for(lengths)
    pieces = [p[:-40] + [sum(p[-40:])] if len(p) > 60 else p for p in pieces]  # a short decode tail, then a piece
    got, roll = rollout_outputs(inputs, lengths, pieces, initial=state, device="cuda")
    assert torch.equal(got, want) and torch.equal(roll.states, want_final)
