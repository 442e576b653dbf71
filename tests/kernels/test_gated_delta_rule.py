"""gated_delta_rule's CPU reference: parity with transformers' torch paths, the backward, the errors;
and (marked gpu) the Triton kernels at real shapes. The rollout's bits against training's are
test_gated_delta_rollout.py."""

import importlib
import inspect
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint, noop_context_fn
from transformers.models.qwen3_next import modeling_qwen3_next

from vexact_models.kernels import checkpoint_saving_context
from vexact_models.kernels.gated_delta_rule import gated_delta_rule

from .gated_delta_support import QWEN35_HEADS, cu, make_inputs


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


def _checkpointed_region(q, k, v, g, beta, state, lengths):
    """A checkpointed region around the rule: something recomputable on each side of it."""
    out, final = gated_delta_rule(q * 1.5, k.sin(), v, g, beta, cu(lengths), initial_state=state,
                                  output_final_state=True, chunk_size=16)
    return (out * 2).pow(2).sum() + final.square().sum()


@pytest.mark.parametrize("context_fn, runs", [(checkpoint_saving_context, 1), (noop_context_fn, 2)],
                         ids=["saving", "full recompute"])
def test_checkpointing_keeps_the_forward(monkeypatch, context_fn, runs):
    """Under `checkpoint_saving_context` the rule's forward (its walk, the dispatcher op
    ``vexact::gated_delta_forward``) runs once per forward + backward, under full recompute twice;
    the gradients are bitwise those without checkpointing either way."""
    rule = importlib.import_module("vexact_models.kernels.gated_delta_rule")  # the package's name is the op's
    calls = []
    forward = rule.training_forward
    monkeypatch.setattr(rule, "training_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    lengths = [21, 9]
    (q, k, v, g, beta), state = make_inputs(lengths, 1, 2, 16, 16, dtype=torch.float64)
    leaves = [x.double().requires_grad_() for x in (q, k, v, g, beta, state)]
    want = torch.autograd.grad(_checkpointed_region(*leaves, lengths), leaves)
    calls.clear()
    got = torch.autograd.grad(checkpoint(_checkpointed_region, *leaves, lengths, use_reentrant=False,
                                         context_fn=context_fn), leaves)
    assert len(calls) == runs
    assert all(torch.equal(a, b) for a, b in zip(got, want))


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


# --- the Triton kernels on the GPU, at the published head shapes (docs/design.md section 6b) ------------


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
    ``LANE_SUMS`` off); at the published shape a token's step stays at most 600 SASS instructions
    (q and k come prepared by `unit_rows`). The backward's kernels: test_gated_delta_backward.py."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels.gated_delta_recurrent import launch_recurrent, walk_shape
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
    # each launch: q and k prepared (`unit_rows`), then the walk
    assert [kernel.name for kernel in compiled] == ["_unit_rows_kernel"] * 2 + ["_recurrent_kernel"] + \
        ["_unit_rows_kernel"] * 2 + ["_recurrent_kernel"]
    for kernel in compiled:
        used = resources(kernel)
        assert used.mma == "none" and used.spill_bytes == 0, used
        if kernel.name == "_recurrent_kernel":
            assert used.num_warps == walk_shape(2, hv, dv).warps, used
            if heads == QWEN35_HEADS:  # the l2 norms in the loop took 1,476 (docs/design.md section 6b)
                assert used.loop_instructions <= 600, used


def test_the_training_forward_walks_long_segments_in_narrow_blocks(monkeypatch):
    """32 sequences at Qwen3.5's heads (1,024 state heads), compiled for sm_90: the training
    forward's walk of 16-token sequences (its plan on the host) launches 16 x 1, a rollout step of
    32 one-token segments (a staged plan) 32 x 2, and a training forward of 2-token sequences,
    short walks, 32 x 2 too (`walk_shape`: `LONG_WALK`)."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sm90_compile import compile_only

    from vexact_models.kernels.gated_delta_recurrent import LONG_WALK, launch_recurrent
    from vexact_models.kernels.gated_delta_rule import training_forward
    from vexact_models.kernels.gated_delta_step import StepPlan, plan_step

    hv, dk, dv = QWEN35_HEADS[1:]
    blocks = {}
    for lengths in ([LONG_WALK] * 32, [2] * 32):
        (q, k, v, g, beta), state = make_inputs(lengths, *QWEN35_HEADS, dtype=torch.bfloat16)
        with compile_only() as compiled:
            training_forward(q, k, v, g, beta, state, lengths, dk ** -0.5, True, True, "triton")
        blocks[lengths[0]] = (compiled[-1].name, compiled[-1].metadata.num_warps)
    (q, k, v, g, beta), _ = make_inputs([1] * 32, *QWEN35_HEADS, dtype=torch.bfloat16)
    pool, out = torch.zeros(33, hv, dk, dv), torch.empty(32, hv, dv, dtype=torch.bfloat16)
    step = StepPlan({n: torch.from_numpy(a) for n, a in plan_step(list(range(32)), [4] * 32, [1] * 32, 32, 32, 32).items()})
    with compile_only() as compiled:
        launch_recurrent("triton", q, k, v, g, beta, pool, out, step.segments(), dk ** -0.5, True)
    blocks["step"] = (compiled[-1].name, compiled[-1].metadata.num_warps)
    # one warp: 16 x 1 (8 x 1 is for at most 128 state heads); two: 32 x 2
    assert blocks == {LONG_WALK: ("_recurrent_kernel", 1), 2: ("_recurrent_kernel", 2), "step": ("_recurrent_kernel", 2)}


@pytest.mark.parametrize("heads", [QWEN35_HEADS, (1, 2, 16, 64)])
def test_every_walk_shape_compiles_for_hopper_without_spills_or_fmas(monkeypatch, heads):
    """Each of `WALK_SHAPES`' launch shapes, forced on a rollout step's walk at Qwen3.5's heads and
    at dk 16 (where the compiler contracted one product an element in the narrow shape and two in the
    others while contraction was on), compiles for sm_90 with its warps, no dot, no spill
    (`register_cap` where the block fits it) and no FMA: every product rounded on its own, so the
    shapes compute alike."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sm90_compile import compile_only, resources

    from vexact_models.kernels import gated_delta_recurrent as walk
    from vexact_models.kernels.gated_delta_step import StepPlan, plan_step

    (q, k, v, g, beta), _ = make_inputs([1, 1], *heads, dtype=torch.bfloat16)
    hv, dk, dv = heads[1:]
    pool, out = torch.zeros(3, hv, dk, dv), torch.empty(2, hv, dv, dtype=torch.bfloat16)
    step = StepPlan({n: torch.from_numpy(a) for n, a in plan_step([1, 0], [4, 0], [1, 1], 2, 2, 4).items()})
    shapes = [shape for _, shape in walk.WALK_SHAPES]
    assert len(set(shapes)) == len(shapes) == 3
    for shape in shapes:
        monkeypatch.setattr(walk, "WALK_SHAPES", ((0, shape),))
        with compile_only() as compiled:
            walk.launch_recurrent("triton", q, k, v, g, beta, pool, out, step.segments(), dk ** -0.5, True)
        used = resources(compiled[-1])
        assert compiled[-1].name == "_recurrent_kernel"
        assert (used.num_warps, used.mma, used.spill_bytes) == (shape.warps, "none", 0), (shape, used)
        ptx = compiled[-1].asm["ptx"]
        assert "fma" not in ptx and "mul.rn.f32" in ptx, shape


def test_fold_chunks_lists_every_chunk_of_the_training_plan():
    from vexact_models.kernels.gated_delta_launch import fold_chunks, training_plans

    fold, rows, _, _ = training_plans([5, 8, 1, 0, 9], chunk=4)
    starts, n_rows, firsts = fold_chunks(fold, 4)
    assert (starts, n_rows) == (rows.kv_start, rows.n_rows)
    assert starts == [0, 4, 5, 9, 13, 14, 18, 22]
    assert n_rows == [4, 1, 4, 4, 1, 4, 4, 1]
    assert firsts == [0, 2, 4, 5, 5]


@pytest.mark.parametrize("want_final", [False, True])
def test_forward_op_fake_matches_the_op(want_final):
    """The dispatcher op's fake (meta) outputs have the real outputs' shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lengths = [5, 3]
    (q, k, v, g, beta), state = make_inputs(lengths, 1, 2, 16, 16, dtype=torch.bfloat16)
    args = (lengths, 0.25, True, want_final, "reference")
    real = torch.ops.vexact.gated_delta_forward(q, k, v, g, beta, state, *args)
    with FakeTensorMode() as mode:
        fake = torch.ops.vexact.gated_delta_forward(*(mode.from_tensor(x) for x in (q, k, v, g, beta, state)), *args)
    assert [(x.shape, x.dtype) for x in fake] == [(x.shape, x.dtype) for x in real]
