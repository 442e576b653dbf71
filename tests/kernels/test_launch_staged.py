"""`launch_staged`: the shared-memory fallback of the attention launchers (Hopper-tuned tiles
that need two pipeline stages run with one on GPUs with less shared memory).

The CPU has no shared-memory limit to hit, so a launcher stands in for a compiled kernel: it
raises triton's own `OutOfResources` (the exception a too-large launch raises at its first call)
when asked for more stages than a pretend GPU holds."""

import pytest

from vexact_models.kernels._triton import HAS_TRITON, OutOfResources, launch_staged

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton's OutOfResources")


class Launcher:
    """``kernel[grid](*args, **kwargs)`` that records its calls and fails above `max_stages`."""

    def __init__(self, max_stages: int) -> None:
        self.max_stages = max_stages
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, num_stages, **kwargs):
            self.calls.append((grid, args, num_stages, kwargs))
            if num_stages > self.max_stages:
                raise OutOfResources(253952, 232448, "shared memory")
        return launch


def test_runs_with_the_asked_stages_when_they_fit():
    kernel = Launcher(max_stages=3)
    launch_staged(kernel, (4, 1, 1), ("q",), {"BLOCK_M": 64}, 2, ("fits",), fp_fusion=True)
    assert kernel.calls == [((4, 1, 1), ("q",), 2, {"BLOCK_M": 64, "enable_fp_fusion": True})]


def test_falls_back_to_one_stage_and_remembers_it():
    kernel = Launcher(max_stages=1)
    launch_staged(kernel, (2,), (), {}, 2, ("small gpu", 1), fp_fusion=False)
    assert [c[2] for c in kernel.calls] == [2, 1]
    assert [c[3] for c in kernel.calls] == [{"enable_fp_fusion": False}] * 2  # the fallback keeps the choice
    launch_staged(kernel, (2,), (), {}, 2, ("small gpu", 1), fp_fusion=True)  # straight to one stage now
    assert [c[2] for c in kernel.calls] == [2, 1, 1]
    other = Launcher(max_stages=3)  # another key (config or device) tries its stages again
    launch_staged(other, (2,), (), {}, 2, ("small gpu", 2), fp_fusion=True)
    assert [c[2] for c in other.calls] == [2]


def test_an_explicit_candidate_runs_as_given_or_raises():
    kernel = Launcher(max_stages=1)
    with pytest.raises(OutOfResources):
        launch_staged(kernel, (1,), (), {}, 2, ("sweep",), fp_fusion=True, fallback=False)
    assert [c[2] for c in kernel.calls] == [2]


def test_one_stage_that_does_not_fit_still_raises():
    kernel = Launcher(max_stages=0)
    with pytest.raises(OutOfResources):
        launch_staged(kernel, (1,), (), {}, 2, ("hopeless",), fp_fusion=True)
    assert [c[2] for c in kernel.calls] == [2, 1]


def test_every_launch_states_its_fp_fusion():
    """No launch leaves FMA contraction to Triton's default (which Triton 3.10 turns off):
    `fp_fusion` has no default."""
    with pytest.raises(TypeError, match="fp_fusion"):
        launch_staged(Launcher(max_stages=3), (1,), (), {}, 1, ("unstated",))
