"""weight_prefetch: a decode GEMM program starts reading its weight rows into L2 before it waits
for its inputs.

A decode step's GEMMs are short (Qwen3-0.6B at 128 sequences: 113 launches of 4-12 MB of weights,
1.0 ms for 0.28 ms of bytes; docs/gpu-results.md, thirty-eighth session): each pays the DRAM
latency of its first loads after the kernel before it has finished. With programmatic dependent
launch (`dependent_launch.py`) a GEMM's programs are resident while that kernel still runs, and
wait in `wait_for_inputs`. The weights are not that kernel's output, so each program can ask for
its rows first, by one bulk L2 prefetch a row (``cp.async.bulk.prefetch.L2``, Hopper), and the
loads after the wait find them in L2.

Why this cannot read a stale weight: a prefetch moves nothing into the program, only into L2,
and L2 is where every SM's writes land (the GPU's point of coherence), so an optimizer step that
writes the weights before the GEMM has run still wins. The arithmetic is untouched: the bits are
the same with the prefetch on or off (docs/design.md rule 1; the GPU test runs both).

``VEXACT_WEIGHT_PREFETCH`` (``auto`` | ``off``, read at every launch) or `use_weight_prefetch`
choose: ``auto`` (the default) prefetches in launches of at most `PREFETCH_MAX_ROWS` rows that
are dependent launches (Hopper and newer, `dependent_launch`) over contiguous, 16-byte aligned
weight rows; ``off`` never. Larger launches read each weight tile many times over and gain
nothing from a head start.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from ._triton import tl, triton
from .dependent_launch import dependent_launch
from .kernel_switch import KernelSwitch

ENV_VAR = "VEXACT_WEIGHT_PREFETCH"
MODES = ("auto", "off")
PREFETCH_MAX_ROWS = 256  # the decode batches: every launch up to the engine's largest graph
_switch = KernelSwitch(ENV_VAR, MODES, "auto", "weight prefetch mode")


def set_weight_prefetch(mode: str | None) -> None:
    """Force ``"off"`` or ``"auto"``; ``None`` hands the choice back to ``VEXACT_WEIGHT_PREFETCH``."""
    _switch.set(mode)


def use_weight_prefetch(mode: str | None) -> AbstractContextManager[None]:
    """`set_weight_prefetch` for a ``with`` block; the previous choice comes back on exit."""
    return _switch.use(mode)


def rows_prefetchable(weight: torch.Tensor) -> bool:
    """Whether every row of the 2-D `weight` is one contiguous run of a multiple of 16 bytes that
    starts 16-byte aligned, as ``cp.async.bulk.prefetch.L2`` needs."""
    size = weight.element_size()
    return (weight.dim() == 2 and weight.stride(1) == 1 and weight.data_ptr() % 16 == 0
            and (weight.stride(0) * size) % 16 == 0 and (weight.shape[1] * size) % 16 == 0)


def weight_prefetch(weight: torch.Tensor, rows: int) -> bool:
    """Whether a GEMM launch of `rows` activation rows over `weight` (``[N, K]``) prefetches its
    weight rows (see the module docstring)."""
    return (_switch.mode() != "off" and 0 < rows <= PREFETCH_MAX_ROWS
            and dependent_launch(weight.device) and rows_prefetchable(weight))


@triton.jit
def prefetch_rows_to_l2(w_ptr, stride_wn, row_bytes, first_row, n_rows,
                        part, parts, BLOCK_N: tl.constexpr):
    """Ask L2 for rows ``first_row .. first_row + BLOCK_N - 1`` (those below `n_rows`) of the
    row-major weight at `w_ptr`, each `row_bytes` long: the rows whose index in the block is
    `part` modulo `parts`, so that the `parts` programs sharing a weight tile split its rows."""
    r = tl.arange(0, BLOCK_N)
    row = first_row + r
    take = ((row < n_rows) & (r % parts == part)).to(tl.int32)
    addr = w_ptr + row.to(tl.int64) * stride_wn
    size = tl.full([BLOCK_N], 0, tl.int32) + row_bytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, take, size], dtype=tl.int32, is_pure=False, pack=1)
