"""conformance/gated_delta_invariance.py's checks, run on the CPU reference at tiny shapes (on the GPU
`kernel_invariance --only gdn` runs them on the Triton kernels at the published shapes)."""

from vexact_models.conformance import gated_delta_invariance
from vexact_models.conformance.gated_delta_invariance import (check_chunk_rows, check_decode, check_engine_rollout,
                                                              check_fold, check_rollout)
from vexact_models.conformance.kernel_invariance import Result


def test_gated_delta_checks_pass_on_the_reference():
    result = Result("gated_delta")
    check_chunk_rows(result, 1, 2, 16, 16, chunk=16, device="cpu")
    check_fold(result, 2, 2, 16, 16, chunk=16, device="cpu")
    check_rollout(result, 1, 2, 16, 16, max_len=90, decode=6, chunk=16, device="cpu")
    check_decode(result, 1, 2, 16, 16, chunk=16, device="cpu")
    check_engine_rollout(result, 1, 2, 16, 16, max_len=90, decode=20, chunk=16, device="cpu")
    assert result.cases == 16 + 8 + 1 + 17 + 1 and result.elements > 0
    assert result.mismatches == 0, result.notes


def test_gated_delta_rollout_check_sees_a_different_chunk_size(monkeypatch):
    """The check compares real outputs: training cut into chunks of 32 rows against a rollout cut
    into chunks of 16 differs (the same values, other roundings), and the check says so."""
    original = gated_delta_invariance.gated_delta_rule  # the training forward the check calls
    monkeypatch.setattr(gated_delta_invariance, "gated_delta_rule",
                        lambda *a, **kw: original(*a, **{**kw, "chunk_size": 32}))
    result = Result("gated_delta")
    check_rollout(result, 1, 1, 16, 16, max_len=70, decode=3, chunk=16, device="cpu")
    assert result.mismatches > 0 and "rollout of lengths" in result.notes[0]
