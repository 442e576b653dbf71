"""gated_delta_rule's CPU reference: parity with transformers' torch paths, the rollout's bits equal to
training's in any split into steps and any batch (one recurrent kernel for both,
`gated_delta_recurrent`), the backward, the errors; and (marked gpu) the Triton kernels at real
shapes."""

import inspect
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next

from vexact_models.kernels.gated_delta_rollout import GatedDeltaRollout
from vexact_models.kernels.gated_delta_rule import gated_delta_rule


def layer_heads(q, k, v):
    """q, k ``[B, T, Hk, d]`` repeated to v's ``Hv`` heads as transformers' Qwen3NextGatedDeltaNet and
    Qwen3_5GatedDeltaNet layers do before calling the functions below (``repeat_interleave`` on the
    head dim: value head ``h`` reads key head ``h // (Hv // Hk)``, the op's convention). Releases up
    to 5.17 need it (the functions take q, k at v's heads); newer ones repeat inside the functions
    too, which then see equal heads."""
    group = v.shape[2] // k.shape[2]
    return q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)


class hf:  # noqa: N801  transformers' torch paths themselves, never the fla kernels its decorator prefers when installed
    _chunk = staticmethod(inspect.unwrap(modeling_qwen3_next.torch_chunk_gated_delta_rule))
    _recurrent = staticmethod(inspect.unwrap(modeling_qwen3_next.torch_recurrent_gated_delta_rule))

    @staticmethod
    def torch_chunk_gated_delta_rule(q, k, v, *args, **kwargs):
        return hf._chunk(*layer_heads(q, k, v), v, *args, **kwargs)

    @staticmethod
    def torch_recurrent_gated_delta_rule(q, k, v, *args, **kwargs):
        return hf._recurrent(*layer_heads(q, k, v), v, *args, **kwargs)


def make_inputs(lengths, hk, hv, dk, dv, *, dtype=torch.float32, device="cpu", seed=0, initial=True):
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lengths), len(lengths)
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.6 - 0.01
    beta = torch.rand(t, hv, generator=gen) * 0.9 + 0.05
    state = torch.randn(b, hv, dk, dv, generator=gen) * 0.2 if initial else None
    cast = [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype)]
    return [x.to(device) for x in cast], (None if state is None else state.to(device))


def cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def rollout_outputs(inputs, lengths, pieces, *, initial=None, device="cpu"):
    """Roll the sequences out in steps: ``pieces[s]`` lists how many tokens sequence ``s`` adds at
    each step (0: it pauses; all sequences share each step's launch, in an order that changes from
    step to step); returns the outputs in packed order and the rollout."""
    q, k, v, g, beta = inputs
    offsets = cu(lengths)
    hk, dk, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    roll = GatedDeltaRollout(len(lengths), (hk, hv), (dk, dv), device=device, initial_state=initial,
                             dtype=torch.float64 if k.dtype == torch.float64 else torch.float32)
    out = torch.zeros(k.shape[0], hv, dv, dtype=q.dtype, device=device)
    done = [0] * len(lengths)
    for step in range(max(len(p) for p in pieces)):
        slots = [s for s in range(len(lengths)) if step < len(pieces[s])]
        slots = slots[step % len(slots):] + slots[:step % len(slots)]  # vary the order
        slots = slots[::-1 if step % 2 else 1]
        counts = [pieces[s][step] for s in slots]
        rows = torch.cat([torch.arange(offsets[s] + done[s], offsets[s] + done[s] + m) for s, m in zip(slots, counts)])
        rows = rows.to(device)
        got = roll.step(*(x[rows] for x in (q, k, v, g, beta)), slots, counts)
        out[rows] = got
        for s, m in zip(slots, counts):
            done[s] += m
    assert done == list(lengths)
    return out, roll


def pieces_for(lengths):
    """Prefill pieces of several sizes (one token, odd and power-of-two sizes, a pause: 0), then
    one token at a time."""
    cuts = [[19, 0, 13, 16], [1, 31, 0], [7, 1, 40], [64]]
    out = []
    for s, n in enumerate(lengths):
        prefill = []
        for m in cuts[s % len(cuts)]:
            if sum(prefill) + m < n:
                prefill.append(m)
        out.append(prefill + [1] * (n - sum(prefill)))
    return out


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 32), (1, 4, 16, 32), (1, 2, 32, 16)])
def test_reference_matches_transformers(hk, hv, dk, dv):
    """Three packed sequences from their own initial states against transformers' recurrent and
    chunked torch paths on each alone, within 1e-5 of the largest value."""
    lengths = [37, 16, 150]
    (q, k, v, g, beta), state = make_inputs(lengths, hk, hv, dk, dv)
    out, final = gated_delta_rule(q, k, v, g, beta, cu(lengths), initial_state=state, output_final_state=True)
    assert out.dtype == torch.float32 and final.dtype == torch.float32
    offsets = cu(lengths)
    for s in range(len(lengths)):
        sl = slice(offsets[s], offsets[s + 1])
        args = [x[sl][None] for x in (q, k, v, g, beta)]
        o_rec, f_rec = hf.torch_recurrent_gated_delta_rule(*args, initial_state=state[s:s + 1], output_final_state=True,
                                                           use_qk_l2norm_in_kernel=True)
        o_chk, _ = hf.torch_chunk_gated_delta_rule(*args, chunk_size=16, initial_state=state[s:s + 1],
                                                   use_qk_l2norm_in_kernel=True)
        scale = o_rec.abs().max()
        assert (out[sl] - o_rec[0]).abs().max() <= 1e-5 * scale
        assert (out[sl] - o_chk[0]).abs().max() <= 1e-5 * scale
        assert (final[s] - f_rec[0]).abs().max() <= 1e-5 * f_rec.abs().max()


def test_forward_does_not_depend_on_chunk_size():
    """`chunk_size` cuts the backward's chunks only: the forward's bits are the same at every size."""
    lengths = [37, 70]
    inputs, state = make_inputs(lengths, 1, 2, 16, 16)
    want, want_final = gated_delta_rule(*inputs, cu(lengths), initial_state=state, output_final_state=True)
    for chunk in (16, 32, 128):
        out, final = gated_delta_rule(*inputs, cu(lengths), initial_state=state, output_final_state=True,
                                      chunk_size=chunk)
        assert torch.equal(out, want) and torch.equal(final, want_final)


def correlated_inputs(t, seed=1):
    """Keys sharing a large common direction, almost no decay, betas near 1: where an unstable
    solve (powers of L) loses every digit."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(1, 1, 16, generator=gen) * 3
    q, k = torch.randn(t, 1, 16, generator=gen) + common, torch.randn(t, 1, 16, generator=gen) + common
    v = torch.randn(t, 1, 16, generator=gen)
    return q, k, v, torch.full((t, 1), -1e-4), torch.rand(t, 1, generator=gen) * 0.1 + 0.9


def test_reference_is_accurate_with_correlated_keys():
    inputs = correlated_inputs(128)
    out, _ = gated_delta_rule(*inputs, chunk_size=64)
    exact, _ = gated_delta_rule(*(x.double() for x in inputs), chunk_size=64)
    assert out.dtype == torch.float32 and exact.dtype == torch.float64
    assert (out.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_reference_without_l2norm_and_with_a_scale():
    lengths = [20]
    (q, k, v, g, beta), _ = make_inputs(lengths, 1, 1, 16, 16, initial=False)
    k = torch.nn.functional.normalize(k, dim=-1) * 0.7
    out, _ = gated_delta_rule(q * 0.25, k, v, g, beta, use_qk_l2norm=False, scale=0.5, chunk_size=16)
    want, _ = hf.torch_recurrent_gated_delta_rule(*(x[None] for x in (q * 0.25 * 0.5 * 4, k, v, g, beta)))
    assert (out - want[0]).abs().max() <= 1e-5 * want.abs().max()


def test_reference_takes_any_head_dims():
    (q, k, v, g, beta), _ = make_inputs([30], 1, 2, 24, 20, initial=False)
    out, _ = gated_delta_rule(q, k, v, g, beta, chunk_size=16)
    want, _ = hf.torch_recurrent_gated_delta_rule(*(x[None] for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)
    assert (out - want[0]).abs().max() <= 1e-5 * want.abs().max()


def test_reference_bf16_inputs():
    (q, k, v, g, beta), state = make_inputs([40], 2, 4, 16, 16, dtype=torch.bfloat16)
    out, final = gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, chunk_size=16)
    want, _ = hf.torch_recurrent_gated_delta_rule(*(x[None] for x in (q, k, v, g, beta)), initial_state=state,
                                                  use_qk_l2norm_in_kernel=True)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert (out.float() - want[0].float()).abs().max() <= 1e-2 * want.float().abs().max()


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


def test_backward_matches_autograd_of_transformers_recurrence():
    lengths = [21, 18]
    (q, k, v, g, beta), state = make_inputs(lengths, 1, 2, 16, 16, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g.double(), beta, state)]
    gen = torch.Generator().manual_seed(5)
    grad_o = torch.randn(sum(lengths), 2, 16, generator=gen, dtype=torch.float64)
    grad_f = torch.randn(2, 2, 16, 16, generator=gen, dtype=torch.float64)
    out, final = gated_delta_rule(*leaves[:5], cu(lengths), initial_state=leaves[5], output_final_state=True,
                                  chunk_size=16)
    got = torch.autograd.grad((out, final), leaves, (grad_o, grad_f))
    offsets, outs, finals = cu(lengths), [], []
    for s in range(2):
        sl = slice(offsets[s], offsets[s + 1])
        o, f = hf.torch_recurrent_gated_delta_rule(*(x[sl][None] for x in leaves[:5]), initial_state=leaves[5][s:s + 1],
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0]), finals.append(f[0])
    want = torch.autograd.grad((torch.cat(outs), torch.stack(finals)), leaves, (grad_o, grad_f))
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name  # transformers computes in fp32


def test_backward_gradcheck_and_dtypes():
    (q, k, v, g, beta), state = make_inputs([18], 1, 1, 16, 16, dtype=torch.float64)
    g, beta = g.double().requires_grad_(), beta.requires_grad_()
    assert torch.autograd.gradcheck(lambda g_, b_: gated_delta_rule(q, k, v, g_, b_, chunk_size=16)[0], (g, beta),
                                    fast_mode=True)
    (q, k, v, g, beta), _ = make_inputs([18], 1, 2, 16, 16, dtype=torch.bfloat16, initial=False)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    gated_delta_rule(*leaves, chunk_size=16)[0].float().square().sum().backward()
    assert [x.grad.dtype for x in leaves] == [torch.bfloat16] * 3 + [torch.float32, torch.bfloat16]
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_errors_name_the_argument():
    (q, k, v, g, beta), state = make_inputs([20], 2, 4, 16, 16)
    with pytest.raises(ValueError, match="chunk_size=24 must be a power of two"):
        gated_delta_rule(q, k, v, g, beta, chunk_size=24)
    with pytest.raises(ValueError, match="cu_seqlens=.* must run from 0 to the token count 20"):
        gated_delta_rule(q, k, v, g, beta, [0, 5, 19])
    with pytest.raises(ValueError, match="cu_seqlens=.* never decreasing"):
        gated_delta_rule(q, k, v, g, beta, [0, 12, 8, 20])
    with pytest.raises(ValueError, match="multiple of its 2 heads"):
        gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3])
    with pytest.raises(ValueError, match="g .* must be \\[tokens, v heads\\]"):
        gated_delta_rule(q, k, v, g[:, :2], beta)
    with pytest.raises(ValueError, match="beta has dtype torch.float64"):
        gated_delta_rule(q, k, v, g, beta.double())
    with pytest.raises(ValueError, match="g must be floating point"):
        gated_delta_rule(q, k, v, g.long(), beta)
    with pytest.raises(ValueError, match="q has 19 rows, k has 20"):
        gated_delta_rule(q[:19], k, v, g, beta)
    with pytest.raises(ValueError, match="q \\(20, 2, 8\\) must be \\[rows, 2, 16\\] like k"):
        gated_delta_rule(q[..., :8], k, v, g, beta)
    with pytest.raises(ValueError, match="initial_state has 1 states for 2 sequences"):
        gated_delta_rule(q, k, v, g, beta, [0, 10, 20], initial_state=state)
    with pytest.raises(ValueError, match="initial_state \\(1, 4, 16, 8\\) must be float \\[states, 4, 16, 16\\]"):
        gated_delta_rule(q, k, v, g, beta, initial_state=state[..., :8])


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


# --- the Triton kernels on the GPU, at the published head shapes (docs/design.md section 6b) ------------

QWEN35_HEADS = (16, 32, 128, 128)  # Qwen3.5-35B-A3B, Qwen3.5's default text config, Qwen3-Next-80B-A3B


def hf_per_sequence(inputs, lengths, state, *, grad=False):
    """transformers' chunked torch path on each sequence alone (fp32 matmuls, no TF32)."""
    offsets, outs, finals = cu(lengths), [], []
    for s in range(len(lengths)):
        sl = slice(offsets[s], offsets[s + 1])
        o, f = hf.torch_chunk_gated_delta_rule(*(x[sl][None] for x in inputs), initial_state=state[s:s + 1],
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0]), finals.append(f[0])
    return torch.cat(outs), torch.stack(finals)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_transformers(dtype):
    lengths = [300, 64, 129, 1]
    inputs, state = make_inputs(lengths, *QWEN35_HEADS, dtype=dtype, device="cuda")
    out, final = gated_delta_rule(*inputs, cu(lengths), initial_state=state, output_final_state=True)
    want, want_final = hf_per_sequence(inputs, lengths, state)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and final.dtype == torch.float32
    assert (out.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    assert (final - want_final).abs().max() <= 1e-4 * want_final.abs().max()


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


class _Results(dict):
    """`run_gated_delta`'s tallies, created under whatever names it reports them."""

    def __missing__(self, name):
        from vexact_models.conformance.invariance_result import Result

        self[name] = Result(name)
        return self[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_invariance_checks():
    """`kernel_invariance --only gdn --quick`'s checks (rollouts in pieces and decodes, the engine's
    steps, at the published head shapes): every check ran cases, zero mismatches."""
    from vexact_models.conformance.gated_delta_invariance import run_gated_delta

    results = _Results()
    run_gated_delta(results, quick=True)
    assert results and all(r.cases for r in results.values())
    assert not any(r.mismatches for r in results.values()), [r.notes for r in results.values()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_backward_matches_autograd_of_transformers():
    lengths = [200, 57]
    inputs, state = make_inputs(lengths, 2, 4, 128, 128, device="cuda")
    grads = []
    for run in ("ours", "transformers"):
        leaves = [x.clone().requires_grad_() for x in (*inputs, state)]
        if run == "ours":
            out, final = gated_delta_rule(*leaves[:5], cu(lengths), initial_state=leaves[5], output_final_state=True)
        else:
            out, final = hf_per_sequence(leaves[:5], lengths, leaves[5])
        (out.square().sum() + final.sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), *grads):
        assert (a - b).abs().max() <= 1e-3 * b.abs().max(), name


@pytest.mark.parametrize("heads,dtype", [(QWEN35_HEADS, torch.bfloat16), ((1, 1, 16, 8), torch.float32)])
def test_triton_kernels_compile_for_hopper_on_cpu(monkeypatch, heads, dtype):
    """The forward's one kernel (`gated_delta_recurrent._recurrent_kernel`) compiles for sm_90
    without a GPU (the interpreter accepts code the compiler refuses, e.g. a global that is not a
    `tl.constexpr`), in the training forward and in a rollout step alike: one warp, no dot (the
    recurrence is elementwise products and fixed-order sums), no spill, at the published head
    shape (a [16, 128] block of the state a program) and at dv = 8 (the sums by split halves,
    ``LANE_SUMS`` off). The backward's kernels: test_gated_delta_backward.py."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels.gated_delta_recurrent import RECURRENT_WARPS, launch_recurrent
    from vexact_models.kernels.gated_delta_rule import training_forward
    from vexact_models.kernels.gated_delta_step import StepPlan, plan_step

    (q, k, v, g, beta), state = make_inputs([5, 3], *heads, dtype=dtype)
    hv, dk, dv = heads[1:]
    pool, out = torch.zeros(3, hv, dk, dv), torch.empty(8, hv, dv, dtype=dtype)
    step = StepPlan({n: torch.from_numpy(a) for n, a in plan_step([1, 0], [4, 0], [5, 3], 2, 8, 4).items()})
    with compile_only() as compiled:
        training_forward(q, k, v, g, beta, state, [5, 3], dk ** -0.5, True, True, "triton")
        # gated_delta_step's launch (its backend check wants a CUDA tensor): the staged plan's int32 arrays
        launch_recurrent("triton", q, k, v, g, beta, pool, out, step.segments(), dk ** -0.5, True)
    assert [kernel.name for kernel in compiled] == ["_recurrent_kernel"] * 2
    for kernel in compiled:
        used = resources(kernel)
        assert used.num_warps == RECURRENT_WARPS and used.mma == "none" and used.spill_bytes == 0, used
