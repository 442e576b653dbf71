"""Parameters as consecutive slices of one buffer: what lets a group of projections (and their
LoRA adapters) run as one GEMM while each parameter stays its own object, name and value
(docs/design.md section 3, fused rollout projections). `projections` fuses the base weights and
biases, `adapters` the adapters' A and B matrices; both read the fused views back from here."""

from __future__ import annotations

import torch


def share_one_buffer(tensors: list[torch.Tensor]) -> None:
    """Make `tensors` (parameters) views of consecutive slices of one new buffer, unless they already are."""
    if fused_view(tensors) is not None:
        return
    with torch.no_grad():
        buffer = torch.cat([t.detach() for t in tensors])
        row = 0
        for t in tensors:
            t.data = buffer[row:row + t.shape[0]]
            row += t.shape[0]


def fused_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The ``[sum N, *rest]`` view spanning `tensors` (weights ``[N, K]`` or biases ``[N]``) when
    they are consecutive rows of one storage, else None."""
    first = tensors[0]
    rest, size = first.shape[1:], first.element_size()
    address, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for t in tensors:  # same storage, not just adjacent allocations
        if not t.is_contiguous() or t.shape[1:] != rest or t.dtype != first.dtype or t.data_ptr() != address \
                or t.untyped_storage().data_ptr() != storage:
            return None
        address += t.numel() * size
    strides = [1]
    for dim in reversed(rest):
        strides.insert(0, strides[0] * dim)
    return first.detach().as_strided((sum(t.shape[0] for t in tensors), *rest), strides)
