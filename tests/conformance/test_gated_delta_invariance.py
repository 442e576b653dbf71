"""conformance/gated_delta_invariance.py's checks, run on the CPU reference at tiny shapes (on the GPU
`kernel_invariance --only gdn` runs them on the Triton kernel at the published shapes), and shown
to fail where the invariance they check is broken."""

import numpy as np

from vexact_models.conformance import gated_delta_invariance
from vexact_models.conformance.gated_delta_invariance import check_batch, check_engine_rollout, check_rollout
from vexact_models.conformance.kernel_invariance import Result
from vexact_models.kernels.gated_delta_rollout import GatedDeltaRollout
from vexact_models.runtime import linear_state_cache


def test_gated_delta_checks_pass_on_the_reference():
    """Every check at tiny shapes (GQA and equal heads): its cases ran, zero mismatches."""
    for hk, hv in ((1, 2), (2, 2)):
        batch, rollout, engine = Result("batch"), Result("rollout"), Result("engine")
        check_batch(batch, hk, hv, 16, 16, max_len=40, device="cpu")
        check_rollout(rollout, hk, hv, 16, 16, max_len=70, decode=6, device="cpu")
        check_engine_rollout(engine, hk, hv, 16, 16, max_len=70, decode=10, device="cpu")
        # 10 sequences alone (the empty one is not run alone) + 5 compositions, two outputs each, twice
        assert batch.cases == 2 * 2 * (10 + 5) and batch.elements > 0
        assert rollout.cases == 2 * 3  # the states halfway, the outputs, the final states, twice
        # two a step (the dry run's), at least one prefill step and 10 decode steps, then two
        assert engine.cases % 2 == 0 and engine.cases >= 2 * 11 + 2 and engine.elements > 0
        for r in (batch, rollout, engine):
            assert r.mismatches == 0, r.notes


def test_batch_check_sees_an_output_that_depends_on_the_batch(monkeypatch):
    """A training forward whose bits depend on the batch (here: a scale nudged by the launch's
    sequence count) is caught by the batch check: alone != in the batch."""
    original = gated_delta_invariance.gated_delta_rule

    def batch_dependent(q, k, v, g, beta, cu, **kw):
        return original(q, k, v, g, beta, cu, **kw, scale=16 ** -0.5 * (1 + 2 ** -20 * (len(cu) - 2)))

    monkeypatch.setattr(gated_delta_invariance, "gated_delta_rule", batch_dependent)
    result = Result("batch")
    check_batch(result, 1, 2, 16, 16, max_len=20, device="cpu")
    assert result.mismatches > 0 and any("outputs" in note for note in result.notes)
    assert not any("final states" in note for note in result.notes)  # the scale touches the outputs alone


def test_rollout_check_sees_a_rollout_that_loses_state_bits(monkeypatch):
    """A rollout whose kept state is off by an ulp after each step (a state round-tripped through
    another precision, say) differs from training, and the rollout check says so."""

    class Drifting(GatedDeltaRollout):
        def step(self, *args):
            out = super().step(*args)
            self.states.mul_(1 + 2 ** -23)
            return out

    monkeypatch.setattr(gated_delta_invariance, "GatedDeltaRollout", Drifting)
    result = Result("rollout")
    check_rollout(result, 1, 2, 16, 16, max_len=30, decode=3, device="cpu")
    assert result.mismatches > 0 and any("rollout of lengths" in note for note in result.notes)


def test_engine_check_sees_a_dry_run_that_writes_the_slots(monkeypatch):
    """A graph warm-up that advances the slots' states (a `dry_run` that keeps the plan's state
    writes) is caught: the dry run changed a slot, and the step after it no longer equals training."""

    def leaky(plan, pool_slots):
        out = {name: a.copy() for name, a in plan.items()}
        out["slot"][:] = -1
        return out

    monkeypatch.setattr(linear_state_cache, "dry_run", leaky)
    result = Result("engine")
    check_engine_rollout(result, 1, 2, 16, 16, max_len=30, decode=3, device="cpu")
    assert any("the dry run writes no slot" in note for note in result.notes)
    assert any("engine rollout of lengths" in note and "outputs" in note for note in result.notes)


def test_engine_check_pads_plans_to_bucket_capacities(monkeypatch):
    """The engine check's steps run at padded capacities (powers of two from 8 tokens and 4
    sequences) with the padding rows NaN: the plans it stages say so."""
    seen = []
    fill = linear_state_cache.LinearStepBuffers.fill

    def spy(self, slots, starts, counts, tokens, seqs):
        seen.append((int(np.sum(counts)), len(counts), tokens, seqs))
        return fill(self, slots, starts, counts, tokens, seqs)

    monkeypatch.setattr(linear_state_cache.LinearStepBuffers, "fill", spy)
    result = Result("engine")
    check_engine_rollout(result, 1, 2, 16, 16, max_len=30, decode=3, device="cpu")
    assert result.mismatches == 0, result.notes
    assert all(tokens >= max(n, 8) and tokens & (tokens - 1) == 0 and seqs >= max(m, 4) for n, m, tokens, seqs in seen)
    assert any(tokens > n for n, _, tokens, _ in seen) and any(seqs > m for _, m, _, seqs in seen)
