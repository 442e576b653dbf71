"""Programmatic dependent launch (PDL): let a kernel's programs start while the kernel before it
on the stream is still finishing.

A decode step is ~270 kernels of a few microseconds each, run back to back from one CUDA graph.
Without PDL each launch waits for the previous kernel to drain and flush before its first program
starts; with it (Hopper and newer) the next kernel's programs are made resident as soon as every
program of the previous one has started, and each of them waits in ``griddepcontrol.wait`` (Triton's
`gdc_wait`) for the previous kernel to complete and its writes to become visible. quack's SM90 GEMM
already launches this way; this module does it for ours.

On the H200 (`benchmarks/decode_profile.py`, 2026-11-26) the decode step of Qwen3-0.6B at 128
sequences took 3.55 -> 3.32 ms with quack's GEMMs (whose launches already were dependent, so that
only now do both sides of each boundary overlap), 5.91 -> 5.70 at 256; Qwen3-8B moved by -1% to
+2%; without quack the steps moved by under 2% (Moonlight's MoE and MLA kernels: 1.01x). Decode attention launches of few programs
(`attention_tiles.few_decode_programs`) stay ordinary launches: launched dependently they took
1.27x as long.

The contract, for every kernel that takes ``PDL``: its first statement is `wait_for_inputs(PDL)`,
before any load or store, so nothing it reads or overwrites can race the kernel before it (or,
transitively, any earlier one: that kernel waited the same way). The arithmetic is untouched, so
the bits are the same with PDL on or off (docs/design.md rule 1; the GPU tests run both).

``VEXACT_PDL`` (``auto`` | ``off``, read at every launch) or `use_dependent_launch` choose: ``auto``
(the default) launches with PDL on CUDA GPUs of compute capability 9 or newer and never elsewhere
(the CPU interpreter, older GPUs, which lack it), ``off`` never.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from ._triton import HAS_TRITON, has_tma, tl, triton
from .kernel_switch import KernelSwitch

if HAS_TRITON:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV_VAR = "VEXACT_PDL"
MODES = ("auto", "off")
_switch = KernelSwitch(ENV_VAR, MODES, "auto", "programmatic dependent launch mode")


def set_dependent_launch(mode: str | None) -> None:
    """Force ``"off"`` or ``"auto"``; ``None`` hands the choice back to ``VEXACT_PDL``."""
    _switch.set(mode)


def use_dependent_launch(mode: str | None) -> AbstractContextManager[None]:
    """`set_dependent_launch` for a ``with`` block; the previous choice comes back on exit."""
    return _switch.use(mode)


def dependent_launch(device: torch.device | str) -> bool:
    """Whether kernels launched now on `device` use PDL (see the module docstring): capability 9
    is where both PDL and TMA arrive, hence `has_tma`."""
    return _switch.mode() != "off" and has_tma(device)


def dependent_launch_kwargs(device: torch.device | str, allowed: bool = True) -> dict:
    """The keyword arguments a launch of a kernel with a ``PDL`` parameter takes on `device`:
    ``PDL=True, launch_pdl=True`` where `dependent_launch` says so and the caller `allowed` it for
    this launch's shape, else ``PDL=False``."""
    if allowed and dependent_launch(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernel before this one on the stream has completed and its writes are
    visible, then let the kernel after this one start its programs. A no-op when ``PDL`` is
    false, and safe (immediate) in a kernel launched without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
