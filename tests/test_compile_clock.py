"""benchmarks/compile_clock.py: Triton compiles counted inside a block, through Triton's own JIT
hooks, on a real compile (for sm_90 on the CPU, `sm90_compile.compile_only`)."""

from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")  # (the compat venvs have none)
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@triton.jit
def _scaled_copy(src, dst, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n) * SCALE, mask=offs < n)


def test_compile_clock_counts_each_new_specialisation_once_and_chains_the_hooks_it_found(monkeypatch):
    """Two specialisations (SCALE 2 and 3) compile inside the block, a second launch of the first
    is a JIT cache hit and counts nothing; a hook already set still sees every compile, and both
    hooks are Triton's again after the block."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from compile_clock import CompileClock
    from sm90_compile import compile_only

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["fn"].name))
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    before = knobs.runtime.jit_post_compile_hook
    src, dst = torch.zeros(64), torch.zeros(64)
    with compile_only(), CompileClock() as clock:
        for scale in (2.0, 3.0, 2.0):
            _scaled_copy[(1,)](src, dst, 64, SCALE=scale, BLOCK=64)
    assert clock.count == 2 and clock.kernels == {"_scaled_copy": 2} and clock.seconds > 0
    assert seen == ["_scaled_copy", "_scaled_copy"]
    assert knobs.runtime.jit_post_compile_hook is before and knobs.runtime.jit_cache_hook is None
    assert clock.summary().startswith("2 (") and "_scaled_copy x2" in clock.summary()
    with CompileClock() as idle:
        pass
    assert idle.count == 0 and idle.summary() == "0"


def test_compile_clock_puts_the_hooks_back_when_the_block_raises(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from compile_clock import CompileClock

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    with pytest.raises(RuntimeError, match="inside"):
        with CompileClock():
            assert knobs.runtime.jit_cache_hook is not None
            raise RuntimeError("inside")
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
