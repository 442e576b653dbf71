"""The side stream of a CUDA device and the fork of work onto it: the layer below
`vexact_models/side_stream.py` (whose docstring holds the protocol and the measurements), here so
that kernels' own launchers can begin work beside the current stream too (`moe_lora.py`'s
shrink and B copy beside the expert GEMMs).

A fork starts where the current stream is now and returns an event; the consumer makes its
stream wait for that event before it reads the result. Only inside CUDA-graph captures without
autograd (`forks_here`): the same kernels on the same inputs, so the bits cannot move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from .kernel_switch import KernelSwitch

__all__ = ["LORA_SHRINK", "begin_beside", "forks_here", "side_stream"]

T = TypeVar("T")

#: ``VEXACT_LORA_SHRINK``: ``side`` (the default: a LoRA group's shrink beside its base GEMM, where
#: `vexact_models.side_stream.shrink_beside` or `moe_lora.moe_lora_shrink_beside` may) or ``inline``
LORA_SHRINK = KernelSwitch("VEXACT_LORA_SHRINK", ("side", "inline"), "side", "LoRA shrinks' placement")

_streams: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA `device`, one per device for the process (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    return _streams[index]


def forks_here(x: torch.Tensor) -> bool:
    """Whether work on `x` may begin on the side stream: a CUDA tensor, a CUDA graph being captured,
    autograd off."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing() and not torch.is_grad_enabled()


def begin_beside(work: Callable[[], T], device: torch.device) -> tuple[T, torch.cuda.Event]:
    """`work()` on the side stream of `device`, started where the current stream is now, and the
    event its result is ready at."""
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        out = work()
        ready = torch.cuda.Event()
        ready.record(side)
    return out, ready
