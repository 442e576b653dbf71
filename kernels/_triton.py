"""Optional Triton import: the package imports (and the reference backend runs) without it."""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: kernels are defined but never launched
    HAS_TRITON = False

    def _jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    triton = types.SimpleNamespace(jit=_jit, cdiv=lambda a, b: -(-a // b), next_power_of_2=None)
    tl = types.SimpleNamespace(constexpr=int)


def require_triton(op: str) -> None:
    """Raise a clear error when the triton backend is chosen but triton is not installed."""
    if not HAS_TRITON:
        raise ImportError(f"{op}: backend 'triton' needs the triton package (pip install 'vexact-models[gpu]')")


def next_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()
