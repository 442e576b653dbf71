"""gated_delta_recurrent on the reference backend (`recurrent_reference`, the CPU twin of the
Triton kernel): parity with transformers' ``torch_recurrent_gated_delta_rule``, float64, what a
plan's entries read and write (padding entries, ``state_in``/``state_out`` of -1, in place), and a
segment's bits independent of the other segments, their order and the launch's batch."""

import inspect

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next

from vexact_models.kernels.gated_delta_recurrent import (
    LONG_WALK,
    LONG_WALK_SHAPES,
    WALK_SHAPES,
    RecurrentPlan,
    WalkShape,
    launch_grid,
    launch_recurrent,
    recurrent_reference,
    register_cap,
    walk_shape,
)

_hf_recurrent = inspect.unwrap(modeling_qwen3_next.torch_recurrent_gated_delta_rule)  # never the fla kernel


def rows(t, hk, hv, dk, dv, *, dtype=torch.float32, seed=0):
    """q, k ``[t, Hk, dk]``, v ``[t, Hv, dv]``, g, beta ``[t, Hv]`` (g fp32, the rest in `dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.6 - 0.01
    beta = torch.rand(t, hv, generator=gen) * 0.9 + 0.05
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)]


def random_states(n, hv, dk, dv, *, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hv, dk, dv, generator=gen) * 0.2).to(dtype)


def run(inputs, states, plan, *, scale=None, l2norm=True, out=None):
    """`recurrent_reference` on `plan`; returns the outputs (NaN where no segment wrote)."""
    q, k, v = inputs[:3]
    if out is None:
        out = torch.full((k.shape[0], v.shape[1], v.shape[2]), float("nan"), dtype=q.dtype)
    scale = k.shape[2] ** -0.5 if scale is None else scale
    recurrent_reference(*inputs, states, out, plan, scale, l2norm)
    return out


def hf(inputs, initial, *, l2norm=True):
    """transformers' recurrence on one sequence (q, k repeated to v's heads as its layers do)."""
    q, k, v, g, beta = inputs
    group = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    o, f = _hf_recurrent(*(x[None] for x in (q, k, v, g, beta)), initial_state=initial, output_final_state=True,
                         use_qk_l2norm_in_kernel=l2norm)
    return o[0], f[0]


def textbook(inputs, state, scale):
    """The recurrence in float64 as written (``S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q``,
    q and k over ``sqrt(|x|^2 + 1e-6)``) by einsum: an oracle independent of the kernel's sums."""
    q, k, v, g, beta = (x.double() for x in inputs)
    group = v.shape[1] // k.shape[1]
    q, k = ((x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(group, dim=1) for x in (q, k))
    s, outs = state.double().clone(), []
    for t in range(k.shape[0]):
        s = s * g[t].exp()[:, None, None]
        u = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[t] * scale))
    return torch.stack(outs), s


@pytest.mark.parametrize("hk,hv,dk,dv,l2norm", [(2, 2, 16, 32, True), (1, 4, 32, 16, True), (1, 2, 16, 8, False)])
def test_reference_matches_transformers_recurrence(hk, hv, dk, dv, l2norm):
    """Two sequences from their own initial states in one launch, against transformers' loop on
    each, within 1e-5 of the largest value (fp32 both; the sums' orders differ)."""
    inputs = rows(57, hk, hv, dk, dv)
    if not l2norm:  # keys of norm below 1 keep the recurrence contracting
        inputs[1] = torch.nn.functional.normalize(inputs[1], dim=-1) * 0.8
    states = random_states(2, hv, dk, dv)
    initial = states.clone()
    out = run(inputs, states, RecurrentPlan([0, 40], [40, 17], [0, 1], [0, 1]), l2norm=l2norm)
    for b, part in enumerate((slice(0, 40), slice(40, 57))):
        want, want_final = hf([x[part] for x in inputs], initial[b:b + 1], l2norm=l2norm)
        assert (out[part] - want).abs().max() <= 1e-5 * want.abs().max()
        assert (states[b] - want_final).abs().max() <= 1e-5 * want_final.abs().max()


def test_reference_in_float64_matches_the_textbook_recurrence():
    """fp64 rows and states compute in fp64: 1e-12 of the fp64 oracle, where fp32 is only ~1e-7."""
    inputs = rows(40, 1, 2, 16, 16, dtype=torch.float64)
    start = random_states(1, 2, 16, 16, dtype=torch.float64)
    want, want_final = textbook(inputs, start[0], 0.25)
    states = start.clone()
    out = run(inputs, states, RecurrentPlan([0], [40], [0], [0]))
    assert out.dtype == torch.float64 and states.dtype == torch.float64
    assert (out - want).abs().max() <= 1e-12 * want.abs().max()
    assert (states[0] - want_final).abs().max() <= 1e-12 * want_final.abs().max()
    states32 = start.float()
    out32 = run([x.float() for x in inputs], states32, RecurrentPlan([0], [40], [0], [0]))
    assert (out32.double() - want).abs().max() > 1e-10 * want.abs().max()  # the check above can tell


def test_reference_takes_a_head_dim_that_is_no_power_of_two():
    """dk = 24 (the sums over dk padded with zeros), dv = 20, against the fp64 oracle."""
    inputs = rows(30, 1, 2, 24, 20, dtype=torch.float64)
    states = random_states(1, 2, 24, 20, dtype=torch.float64)
    want, want_final = textbook(inputs, states[0], 24 ** -0.5)
    out = run(inputs, states, RecurrentPlan([0], [30], [0], [0]))
    assert (out - want).abs().max() <= 1e-12 * want.abs().max()
    assert (states[0] - want_final).abs().max() <= 1e-12 * want_final.abs().max()


def test_padding_entries_write_nothing():
    """Entries of count 0 (a CUDA graph's padding) write no row and no state, even naming a
    state to write; a plan of padding only returns at once."""
    inputs = rows(12, 1, 2, 16, 16)
    states = random_states(3, 2, 16, 16)
    before = states.clone()
    alone = run(inputs, states.clone(), RecurrentPlan([0], [12], [1], [2]))
    out = run(inputs, states, RecurrentPlan([5, 0, 12], [0, 12, 0], [0, 1, 2], [0, 2, 1]))
    assert torch.equal(out, alone)
    assert torch.equal(states[:2], before[:2]) and not torch.equal(states[2], before[2])
    out = run(inputs, states, RecurrentPlan([0, 3], [0, 0], [0, 1], [0, 1]))
    assert torch.isnan(out).all() and torch.equal(states[:2], before[:2])


def test_state_in_minus_one_starts_from_zeros_and_state_out_minus_one_keeps_nothing():
    inputs = rows(20, 1, 2, 16, 16)
    zeros = torch.zeros(2, 2, 16, 16)
    want = run(inputs, zeros, RecurrentPlan([0], [20], [1], [0]))  # an explicit zero state, kept in 0
    states = random_states(2, 2, 16, 16)
    before = states.clone()
    got = run(inputs, states, RecurrentPlan([0], [20], [-1], [-1]))
    assert torch.equal(got, want) and torch.equal(states, before)
    got = run(inputs, states, RecurrentPlan([0], [20], [-1], [1]))
    assert torch.equal(got, want) and torch.equal(states[1], zeros[0]) and torch.equal(states[0], before[0])


def test_in_place_steps_equal_one_segment():
    """A sequence in steps of 7, 1, 1 and 11 tokens, each from the state the last left in the same
    slot (``state_in == state_out``): the one-segment launch's rows and final state, bitwise."""
    inputs = rows(20, 1, 2, 16, 32)
    start = random_states(1, 2, 16, 32)
    whole_states = start.clone()
    whole = run(inputs, whole_states, RecurrentPlan([0], [20], [0], [0]))
    states, got = start.clone(), torch.empty_like(whole)
    for a, n in ((0, 7), (7, 1), (8, 1), (9, 11)):
        got[a:a + n] = run([x[a:a + n] for x in inputs], states, RecurrentPlan([0], [n], [0], [0]))
    assert torch.equal(got, whole) and torch.equal(states, whole_states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_give_the_same_bits_in_any_order_and_batch(dtype):
    """Four sequences of different lengths launched together, in reversed order with their rows
    packed differently beside a padding entry, and each alone: the same rows and states, bitwise."""
    lengths = [9, 1, 23, 14]
    inputs = rows(sum(lengths), 1, 2, 16, 16, dtype=dtype)
    start = random_states(4, 2, 16, 16)
    starts = [0, 9, 10, 33]
    states = start.clone()
    together = run(inputs, states, RecurrentPlan(starts, lengths, [0, -1, 2, 3], [0, 1, 2, 3]))
    assert not torch.isnan(together).any()
    order = [3, 2, 1, 0]  # the rows repacked in this order
    packed = torch.cat([torch.arange(starts[s], starts[s] + lengths[s]) for s in order])
    at = {s: sum(lengths[r] for r in order[:i]) for i, s in enumerate(order)}
    reordered = start.clone()
    out = run([x[packed] for x in inputs], reordered,
              RecurrentPlan([0] + [at[s] for s in order], [0] + [lengths[s] for s in order],
                            [1] + [[0, -1, 2, 3][s] for s in order], [2] + order))
    assert torch.equal(out[torch.argsort(packed)], together) and torch.equal(reordered, states)
    for s in range(4):
        alone = start.clone()
        sl = slice(starts[s], starts[s] + lengths[s])
        got = run([x[sl] for x in inputs], alone, RecurrentPlan([0], [lengths[s]], [[0, -1, 2, 3][s]], [s]))
        assert torch.equal(got, together[sl]) and torch.equal(alone[s], states[s])


def test_plan_as_tensors_and_the_launch_dispatch():
    """A plan of int32 tensors (a rollout step's staged plan) and `launch_recurrent`'s reference
    backend give the bits of a plan of lists."""
    inputs = rows(15, 2, 4, 16, 16)
    start = random_states(2, 4, 16, 16)
    plan = RecurrentPlan([0, 6], [6, 9], [1, -1], [0, 1])
    want_states = start.clone()
    want = run(inputs, want_states, plan)
    states = start.clone()
    out = torch.empty_like(want)
    tensors = RecurrentPlan(*(torch.tensor(f, dtype=torch.int32) for f in vars(plan).values()))
    launch_recurrent("reference", *inputs, states, out, tensors, 0.25, True)
    assert torch.equal(out, want) and torch.equal(states, want_states)


def test_scale_multiplies_the_queries():
    """Without the l2 norm, q times `scale` and q with scale 1 are the same outputs (a power of two:
    exact)."""
    inputs = rows(10, 1, 1, 16, 16)
    inputs[1] = torch.nn.functional.normalize(inputs[1], dim=-1)
    plain = run(inputs, torch.zeros(1, 1, 16, 16), RecurrentPlan([0], [10], [-1], [-1]), scale=0.5, l2norm=False)
    halved = run([inputs[0] * 0.5, *inputs[1:]], torch.zeros(1, 1, 16, 16), RecurrentPlan([0], [10], [-1], [-1]),
                 scale=1.0, l2norm=False)
    assert torch.equal(plain, halved)
    assert not torch.equal(plain, run(inputs, torch.zeros(1, 1, 16, 16), RecurrentPlan([0], [10], [-1], [-1]),
                                      scale=1.0, l2norm=False))


def test_walk_shape_by_the_launch_state_heads():
    """Few state heads (a training forward's sequences x 32 value heads) take narrow blocks, a
    rollout step's many take wide ones; a block is never wider than dv."""
    assert [least for least, _ in WALK_SHAPES] == sorted((least for least, _ in WALK_SHAPES), reverse=True)
    assert WALK_SHAPES[-1][0] == 0  # every launch has a shape
    assert walk_shape(1, 32, 128) == walk_shape(4, 32, 128) == WalkShape(8, 1)
    assert walk_shape(5, 32, 128) == walk_shape(31, 32, 128) == WalkShape(16, 1)
    assert walk_shape(32, 32, 128) == walk_shape(256, 32, 128) == WalkShape(32, 2)
    assert walk_shape(256, 32, 16) == WalkShape(16, 2)
    assert walk_shape(0, 32, 4) == WalkShape(4, 1)


def test_long_walks_keep_narrow_blocks_at_every_launch_size():
    """A host plan whose longest segment has `LONG_WALK` tokens or more (a training forward) takes
    `LONG_WALK_SHAPES`: 16 columns from 5 sequences of 32 value heads on, however many, where a
    rollout step's (or a plan of short segments) takes 32 x 2 from 32 sequences."""
    assert [least for least, _ in LONG_WALK_SHAPES] == sorted((least for least, _ in LONG_WALK_SHAPES), reverse=True)
    assert LONG_WALK_SHAPES[-1][0] == 0
    assert {shape for _, shape in LONG_WALK_SHAPES} <= {shape for _, shape in WALK_SHAPES}
    assert walk_shape(4, 32, 128, LONG_WALK) == WalkShape(8, 1)
    assert walk_shape(5, 32, 128, LONG_WALK) == walk_shape(256, 32, 128, 4096) == WalkShape(16, 1)
    assert walk_shape(256, 32, 128, LONG_WALK - 1) == walk_shape(256, 32, 128, None) == WalkShape(32, 2)


def test_launch_grid_is_one_axis_and_refuses_past_the_launch_limit():
    assert launch_grid(64, 32, 8) == (64 * 32 * 8,)
    assert launch_grid(0, 32, 8) == (0,)
    with pytest.raises(ValueError, match=r"2\*\*31 - 1"):
        launch_grid(2 ** 20, 2 ** 8, 2 ** 3)


def test_register_cap_only_where_the_state_block_fits_it():
    assert register_cap(128, 16) == {"maxnreg": 168}  # Qwen3.5's and Qwen3-Next's heads
    assert register_cap(64, 16) == {"maxnreg": 168}
    assert register_cap(256, 16) == {}  # 128 state values a thread: more than the cap holds
