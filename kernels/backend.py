"""Backend selection for the aligned ops.

Every op in `vexact_models.kernels` has two implementations behind one call site:

- ``triton``: GPU kernels (CUDA tensors). Also runs on CPU under Triton's interpreter
  (``TRITON_INTERPRET=1``), which the tests use to check kernel *logic*; the interpreter tiles
  through BLAS, so its results are not row-invariant and prove nothing about invariance.
- ``reference``: plain torch on CPU, written so that it obeys the invariance rules by
  construction (see `exact_math`).
- ``fast``: the *non-aligned* fast path (CUDA): stock kernels where they exist (cuBLAS for
  ``linear``, torch for the norms and the activation), Triton elsewhere. Not batch-invariant:
  it exists to measure what alignment costs (``LLM(..., aligned=False)``).

The default is ``triton`` for CUDA tensors and ``reference`` for CPU tensors. Override it with
`set_backend` / `use_backend` (these win over the environment), or the environment variable
``VEXACT_BACKEND`` (``reference``, ``triton``, ``fast`` or ``auto``). The rollout engine runs
the same choice as the training forward: ``LLM`` reads it at each ``generate``
(``LLM.backend``), except that ``LLM(aligned=False)`` always runs ``fast``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from contextlib import AbstractContextManager

import torch

from .kernel_switch import KernelSwitch

BACKENDS = ("reference", "triton", "fast")
#: ``VEXACT_BACKEND``: a backend of `BACKENDS`, or ``auto`` (the default: by device)
_switch = KernelSwitch("VEXACT_BACKEND", BACKENDS + ("auto",), "auto", "backend")


class UnsupportedError(ValueError):
    """Raised when a backend is asked for a device, dtype or shape it does not support."""


def set_backend(name: str | None) -> None:
    """Force a backend for every op (``"reference"``, ``"triton"``), or ``None``/``"auto"`` to
    choose by device."""
    _switch.set(None if name == "auto" else name)


def use_backend(name: str | None) -> AbstractContextManager[None]:
    """Context manager form of `set_backend`; restores the previous choice on exit."""
    return _switch.use(None if name == "auto" else name)


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def current_backend(device: torch.device) -> str:
    """The backend an op on `device` will use."""
    name = _switch.mode()
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" else "reference"


def select(
    op: str,
    tensor: torch.Tensor,
    *,
    dtypes: Iterable[torch.dtype] = (torch.bfloat16, torch.float16, torch.float32),
    head_dim: int | None = None,
    head_dims: Iterable[int] = (),
    fast: bool = False,
) -> str:
    """Pick the backend for `op` on `tensor` and check that it supports the input.

    `dtypes` are what the Triton kernel takes; the reference also takes float64 (the tests
    compare against float64). Ops with a stock implementation pass ``fast=True`` and handle
    ``"fast"``; for the others the fast path is their Triton kernel. Raises `UnsupportedError` naming the op, backend and the
    offending device/dtype/head dim.
    """
    name = current_backend(tensor.device)
    if name == "fast":
        if tensor.device.type != "cuda":
            raise UnsupportedError(f"{op}: backend 'fast' needs a CUDA tensor, got device {tensor.device}")
        if fast:
            return name
        name = "triton"
    dtypes = tuple(dtypes) if name == "triton" else tuple(dtypes) + (torch.float64,)
    if tensor.dtype not in dtypes:
        raise UnsupportedError(
            f"{op}: backend {name!r} does not support dtype {tensor.dtype}; supported: {dtypes}"
        )
    if name == "triton":
        if tensor.device.type != "cuda" and not interpreting():
            raise UnsupportedError(
                f"{op}: backend 'triton' needs a CUDA tensor, got device {tensor.device} "
                "(use the 'reference' backend on CPU, or TRITON_INTERPRET=1 to test kernel logic)"
            )
        head_dims = tuple(head_dims)
        if head_dim is not None and head_dims and head_dim not in head_dims:
            raise UnsupportedError(
                f"{op}: backend 'triton' does not support head_dim={head_dim}; supported: {head_dims}"
            )
    elif tensor.device.type != "cpu":
        raise UnsupportedError(
            f"{op}: backend 'reference' runs on CPU only, got device {tensor.device} "
            "(its invariance is proven for torch's CPU kernels)"
        )
    return name
