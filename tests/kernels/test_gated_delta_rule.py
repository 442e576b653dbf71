"""gated_delta_rule's CPU reference: parity with transformers' torch paths, the rollout's bits equal to
training's, the fold, the backward, the errors; and (marked gpu) the Triton kernels at real shapes."""

import inspect
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next

from vexact_models.kernels.gated_delta_rollout import GatedDeltaRollout
from vexact_models.kernels.gated_delta_rule import gated_delta_chunk_rows, gated_delta_fold, gated_delta_rule


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


def rollout_outputs(inputs, lengths, pieces, *, chunk, initial=None, device="cpu"):
    """Roll the sequences out in steps: ``pieces[s]`` lists how many tokens sequence ``s`` adds at
    each step (all sequences share each step's launches); returns the outputs in packed order and
    the rollout."""
    q, k, v, g, beta = inputs
    offsets = cu(lengths)
    hk, dk, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    roll = GatedDeltaRollout(len(lengths), (hk, hv), (dk, dv), chunk_size=chunk, device=device, initial_state=initial)
    out = torch.zeros(k.shape[0], hv, dv, dtype=q.dtype, device=device)
    done = [0] * len(lengths)
    for step in range(max(len(p) for p in pieces)):
        slots = [s for s in range(len(lengths)) if step < len(pieces[s])][::-1 if step % 2 else 1]  # vary the order
        counts = [pieces[s][step] for s in slots]
        rows = torch.cat([torch.arange(offsets[s] + done[s], offsets[s] + done[s] + m) for s, m in zip(slots, counts)])
        rows = rows.to(device)
        got = roll.step(*(x[rows] for x in (q, k, v, g, beta)), slots, counts)
        out[rows] = got
        for s, m in zip(slots, counts):
            done[s] += m
    assert done == list(lengths)
    return out, roll


def pieces_for(lengths, chunk):
    """Prefill pieces cut on and off chunk boundaries, then one token at a time."""
    cuts = [[chunk // 2 + 3, chunk - (chunk // 2 + 3), chunk + 5], [1, chunk * 2 - 1], [chunk + chunk // 2]]
    out = []
    for s, n in enumerate(lengths):
        prefill = []
        for m in cuts[s % len(cuts)]:
            if sum(prefill) + m < n:
                prefill.append(m)
        out.append(prefill + [1] * (n - sum(prefill)))
    return out


@pytest.mark.parametrize("hk,hv,chunk", [(2, 2, 16), (1, 4, 16), (1, 2, 64)])
def test_reference_matches_transformers(hk, hv, chunk):
    lengths = [37, 16, 150] if chunk == 64 else [37, 16, 50]
    (q, k, v, g, beta), state = make_inputs(lengths, hk, hv, 16, 32)
    out, final = gated_delta_rule(q, k, v, g, beta, cu(lengths), initial_state=state, output_final_state=True,
                                  chunk_size=chunk)
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


@pytest.mark.parametrize("hk,hv,initial,chunk", [(2, 2, False, 16), (1, 2, True, 16), (1, 1, True, 32)])
def test_reference_rollout_equals_training_bitwise(hk, hv, initial, chunk):
    """Training (all sequences packed, whole chunks) against a rollout (prefill in pieces cut on and
    off chunk boundaries, then one token at a time, other sequences in the same launches)."""
    lengths = [45, 35, 29] if chunk == 16 else [90, 70]
    inputs, state = make_inputs(lengths, hk, hv, 16, 16, initial=initial)
    want, _ = gated_delta_rule(*inputs, cu(lengths), initial_state=state, chunk_size=chunk)
    got, roll = rollout_outputs(inputs, lengths, pieces_for(lengths, chunk), chunk=chunk, initial=state)
    assert torch.equal(got, want)
    # the kept boundary states are the training fold's: one run over the whole chunks
    q, k, v, g, beta = inputs
    whole = [n // chunk * chunk for n in lengths]
    folded = gated_delta_fold(k, v, g, beta, cu(lengths)[:-1], whole,
                              state if state is not None else roll.states.new_zeros(roll.states.shape),
                              list(range(len(lengths))), chunk_size=chunk)
    ends = cu([n // chunk for n in lengths])[1:]
    assert all(n >= chunk for n in lengths)
    assert torch.equal(roll.states, folded[[e - 1 for e in ends]])


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


def test_rollout_steps_with_a_slot_adding_nothing():
    inputs, _ = make_inputs([30, 20], 1, 1, 16, 16, initial=False)
    want, _ = gated_delta_rule(*inputs, [0, 30, 50], chunk_size=16)
    roll, got = GatedDeltaRollout(2, (1, 1), (16, 16), chunk_size=16), torch.zeros_like(want)
    for rows, slots, counts in (([*range(7), *range(30, 35)], [0, 1], [7, 5]), (list(range(7, 30)), [1, 0], [0, 23]),
                                (list(range(35, 50)), [0, 1], [0, 15])):
        got[rows] = roll.step(*(x[rows] for x in inputs), slots, counts)
    assert torch.equal(got, want) and roll.positions == [30, 20]


def test_fold_in_one_run_equals_chunk_by_chunk():
    (q, k, v, g, beta), state = make_inputs([64], 1, 2, 16, 16)
    whole = gated_delta_fold(k, v, g, beta, [0], [64], state, [0], chunk_size=16)
    pool = state.clone()
    for c in range(4):  # in place, one chunk a call, as a rollout folds
        gated_delta_fold(k, v, g, beta, [16 * c], [16], pool, [0], out=pool, out_index=[0], chunk_size=16)
        assert torch.equal(pool[0], whole[c])


def test_chunk_rows_equal_training_rows_at_every_row_count():
    (q, k, v, g, beta), state = make_inputs([16], 1, 1, 16, 16)
    want, _ = gated_delta_rule(q, k, v, g, beta, initial_state=state, chunk_size=16)
    for n in range(1, 17):
        for first in sorted({0, n // 2, n - 1}):
            got = gated_delta_chunk_rows(q[first:n], k[:n], v[:n], g[:n], beta[:n], [0, n], [first], state, [0],
                                         chunk_size=16)
            assert torch.equal(got, want[first:n])


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
    with pytest.raises(ValueError, match="multiple of its 2 heads"):
        gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3])
    with pytest.raises(ValueError, match="g .* must be \\[tokens, v heads\\]"):
        gated_delta_rule(q, k, v, g[:, :2], beta)
    with pytest.raises(ValueError, match="beta has dtype torch.float64"):
        gated_delta_rule(q, k, v, g, beta.double())
    with pytest.raises(ValueError, match="initial_state has 1 states for 2 sequences"):
        gated_delta_rule(q, k, v, g, beta, [0, 10, 20], initial_state=state)
    with pytest.raises(ValueError, match="segment 0 has 20 rows \\(at most chunk_size=16\\)"):
        gated_delta_chunk_rows(q, k, v, g, beta, [0, 20], [0], state, [0], chunk_size=16)
    with pytest.raises(ValueError, match="q has 20 rows, the segments ask for 4"):
        gated_delta_chunk_rows(q, k[:16], v[:16], g[:16], beta[:16], [0, 16], [12], state, [0], chunk_size=16)
    with pytest.raises(ValueError, match="state index 3 is outside -1..0"):
        gated_delta_chunk_rows(q[:4], k[:4], v[:4], g[:4], beta[:4], [0, 4], [0], state, [3], chunk_size=16)
    with pytest.raises(ValueError, match="states has dtype torch.float64, must be torch.float32"):
        gated_delta_chunk_rows(q[:4], k[:4], v[:4], g[:4], beta[:4], [0, 4], [0], state.double(), [0], chunk_size=16)
    with pytest.raises(ValueError, match="run 0 \\(starts=10, lengths=16\\) is outside k's 20 rows"):
        gated_delta_fold(k, v, g, beta, [10], [16], state, [0], chunk_size=16)
    with pytest.raises(ValueError, match="run 0 writes out\\[1:3\\], out has 1 states"):
        gated_delta_fold(k, v, g, beta, [0], [20], state, [0], out=state, out_index=[1], chunk_size=16)
    with pytest.raises(ValueError, match="slots=\\[0, 0\\]"):
        GatedDeltaRollout(2, (2, 4), (16, 16), chunk_size=16).step(q, k, v, g, beta, [0, 0], [10, 10])


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
    want, _ = gated_delta_rule(*inputs, cu(lengths), initial_state=state)
    pieces = pieces_for(lengths, 64)
    pieces = [p[:-40] + [sum(p[-40:])] if len(p) > 60 else p for p in pieces]  # a short decode tail, then a piece
    got, _ = rollout_outputs(inputs, lengths, pieces, chunk=64, initial=state, device="cuda")
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_invariance_checks():
    """`kernel_invariance --only gdn --quick`'s checks: every row count and first row of a chunk, folds,
    rollouts, decodes from the kept rows of T and engine rollouts through the decode launch, at the
    published head shapes, zero mismatches."""
    from vexact_models.conformance.gated_delta_invariance import run_gated_delta
    from vexact_models.conformance.kernel_invariance import Result

    results = {name: Result(name) for name in ("gated_delta rows", "gated_delta fold", "gated_delta rollout",
                                               "gated_delta decode", "gated_delta engine")}
    run_gated_delta(results, quick=True)
    assert all(r.cases for r in results.values())
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


def test_triton_kernels_compile_for_hopper_on_cpu(monkeypatch):
    """The kernels compile for sm_90 without a GPU (the interpreter accepts code the compiler
    refuses, e.g. a global that is not a `tl.constexpr`), at a tiny shape and chunk 64 (the
    solve's block rows), their products on the tensor cores and none split into 8-column TF32
    wgmma (`gated_delta_triton.SMALL_HEAD_WARPS`)."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels.gated_delta_rule import training_forward

    (q, k, v, g, beta), _ = make_inputs([70], 1, 1, 16, 16, dtype=torch.bfloat16, initial=False)
    with compile_only() as compiled:
        training_forward(q, k, v, g, beta, None, [70], 64, 0.25, True, True, "triton")
    assert [kernel.name for kernel in compiled] == ["fold_prep_kernel", "fold_kernel", "rows_kernel"]
    for kernel in compiled:
        assert resources(kernel).wgmma > 0, kernel.name
        # 8-column TF32 wgmma: Triton 3.6's fold built so read shared memory out of bounds on the H200
        assert "m64n8k8" not in kernel.asm["ptx"], kernel.name
