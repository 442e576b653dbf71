"""Host time a benchmark's timed region spent compiling Triton kernels.

A region that meets a new kernel specialisation (a constexpr, a dtype, a divisibility of an
argument not seen before) pays its compile in the middle of the measurement: seconds on a
fresh machine, a few milliseconds when the on-disk cache holds it. `CompileClock` counts them,
through Triton's JIT hooks (`triton.knobs.runtime.jit_cache_hook`, called before a compile, and
`jit_post_compile_hook`, after), chaining to any hooks already set and putting them back on exit:

    with CompileClock() as clock:
        llm.generate(...)
    print(clock.count, clock.seconds, clock.kernels)
"""

from __future__ import annotations

import time
from collections import Counter


class CompileClock:
    """Counts the Triton JIT compiles (a cache load included) in its ``with`` block: `count`,
    their host `seconds`, and `kernels` (kernel name -> compiles)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.kernels: Counter[str] = Counter()
        self._started: list[float] = []
        self._saved = None

    def __enter__(self) -> CompileClock:
        from triton import knobs

        runtime = knobs.runtime
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        before, after = self._saved

        def started(**kwargs):
            self._started.append(time.perf_counter())
            return before(**kwargs) if before is not None else None  # True would skip the compile

        def finished(**kwargs):
            if self._started:
                self.seconds += time.perf_counter() - self._started.pop()
            self.kernels[kwargs["fn"].name] += 1
            return after(**kwargs) if after is not None else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = started, finished
        return self

    @property
    def count(self) -> int:
        """Compiles in the block so far."""
        return sum(self.kernels.values())

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved

    def summary(self, most: int = 4) -> str:
        """``"N (S s: name xK, ...)"``: the count, the seconds and the `most` kernels compiled most."""
        if not self.count:
            return "0"
        names = ", ".join(f"{name} x{n}" for name, n in self.kernels.most_common(most))
        return f"{self.count} ({self.seconds:.2f} s: {names})"
