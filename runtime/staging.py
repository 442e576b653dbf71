"""Several host arrays -> the device in ONE copy: pack them into one (pinned) byte buffer, copy
it asynchronously, and view the device bytes back as the original dtypes and shapes.

Every ``cudaMemcpyAsync`` costs host time, and a copy from pageable memory may wait for the
stream, so a step's metadata travels as one pinned buffer. Arrays start at 16-byte aligned
offsets, so each device view is a plain ``Tensor.view(dtype)`` of the byte buffer and its
pointer is as aligned as Triton's specialisation asks (a separate allocation would be too).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["HostCopy", "Layout", "to_device"]

_ALIGN = 16  # 16: what Triton specialises pointer alignment on


class Layout:
    """Where each of a list of ``(dtype, shape)`` arrays sits in one byte buffer."""

    def __init__(self, specs: list[tuple[np.dtype, tuple[int, ...]]]) -> None:
        self.specs = [(np.dtype(dtype), tuple(shape)) for dtype, shape in specs]
        self.offsets: list[int] = []
        self.sizes = [dtype.itemsize * math.prod(shape) for dtype, shape in self.specs]  # bytes
        offset = 0
        for nbytes in self.sizes:
            self.offsets.append(offset)
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset

    def allocate(self, device: torch.device, pin: bool = False) -> torch.Tensor:
        """A fresh uint8 buffer of ``nbytes`` (pinned when ``pin``; never zeroed)."""
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device, pin_memory=pin)

    def host_views(self, buffer: torch.Tensor) -> list[np.ndarray]:
        """numpy views of the arrays in a CPU byte buffer (writes go to the buffer)."""
        raw = buffer.numpy()
        return [raw[o:o + n].view(dtype).reshape(shape)
                for o, n, (dtype, shape) in zip(self.offsets, self.sizes, self.specs)]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """torch views of the arrays in a byte buffer on any device."""
        out = []
        for o, n, (dtype, shape) in zip(self.offsets, self.sizes, self.specs):
            view = buffer[o:o + n].view(_TORCH_DTYPES[dtype])
            out.append(view if len(shape) == 1 else view.view(shape))  # each torch op costs ~1 us
        return out


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32}


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``arrays`` on ``device`` (same dtypes and shapes) through one host->device copy.

    The host buffer is fresh each call (pinned on CUDA): torch's pinned-memory cache does not
    hand it out again before the asynchronous copy that reads it has completed, so the caller
    may build the next step at once. On CPU the packed buffer itself is returned (no copy)."""
    layout = Layout([(a.dtype, a.shape) for a in arrays])
    cuda = device.type == "cuda"
    host = layout.allocate(torch.device("cpu"), pin=cuda)
    for view, array in zip(layout.host_views(host), arrays):
        view[...] = array
    return layout.views(host.to(device, non_blocking=cuda))


class HostCopy:
    """Device tensors on their way to the host: each copied into fresh pinned memory without
    waiting (an event marks the copies' end); `result` waits for them. On CPU the tensors
    themselves."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._ready: torch.cuda.Event | None = None
        if tensors and tensors[0].is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(self._host, tensors):
                host.copy_(t, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = list(tensors)

    def result(self) -> list[torch.Tensor]:
        """The host tensors, once the copies are done (waits for the device)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host
