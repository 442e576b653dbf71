"""as_rows: a tensor as the 2-D rows the row-wise kernels address (a row stride, unit columns).

The norms, the sigmoid gates and the gated DeltaNet's gates take their input as rows ``[R, n]``
read through one row stride with consecutive columns; this gives them that view of any tensor,
copying only where no such view exists (a column stride other than 1). `in_shape` gives a row
kernel's output the input's shape without making a view where the shapes already agree.
"""

from __future__ import annotations

import torch


def as_rows(t: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """`t` as rows ``[R, n]`` (`n` default: its last dimension) with a unit column stride: a view
    where one exists (a strided view of a fused projection stays one), else a contiguous copy."""
    t2d = t.reshape(-1, t.shape[-1] if n is None else n)
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def in_shape(t: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """`t` reshaped to `shape`, or `t` itself where it has that shape already: a reshape to the
    same shape still makes a view, and a view returned by a module FSDP2 shards loses its
    pre-backward hook to an in-place op downstream (torch warns; docs/fsdp.md)."""
    return t if t.shape == shape else t.reshape(shape)
