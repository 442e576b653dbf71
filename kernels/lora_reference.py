"""The CPU twin of `lora.lora_add`'s arithmetic (docs/design.md section 8): the shrink ``x A^T`` in
fixed K chunks of `CHUNK_K`, each chunk's partial one per-output reduction (`exact_math.dot`),
the partials added in chunk order; fp32 A under 16-bit x taken as its two 16-bit halves
(`shrink_operand`); the expand element-wise in rank order, then PEFT's add. The Triton kernels
(`lora.py`) are tested against it; the routed experts' adapters use it per expert
(`moe_lora.py`)."""

from __future__ import annotations

import torch

from . import exact_math

CHUNK_K = 512  # K columns per shrink partial: fixed, so the partials depend on K only


def split_a(x_dtype: torch.dtype, a_dtype: torch.dtype) -> bool:
    """Whether the shrink splits A into two 16-bit halves: fp32 A (PEFT's default) under 16-bit
    activations."""
    return a_dtype == torch.float32 and x_dtype in (torch.bfloat16, torch.float16)


def shrink_operand(a: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """The A the shrink multiplies by, as a tensor of x's compute dtype: A in x's dtype, or for
    fp32 A under 16-bit x (`split_a`) ``hi + lo`` with ``hi = A`` rounded to x's dtype and ``lo``
    the rest rounded likewise (17 significant bits; the sum is exact in fp32)."""
    if not split_a(x_dtype, a.dtype):
        return a.to(x_dtype)
    hi = a.to(x_dtype)
    return hi.float() + (a - hi.float()).to(x_dtype).float()


def lora_shrink_reference(x2d: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The shrink on CPU: each chunk's partial a per-output reduction (`exact_math.dot`), the
    partials added in chunk order; A as the kernel takes it (`shrink_operand`)."""
    compute = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    xw, aw = x2d.to(compute), shrink_operand(a, x2d.dtype).to(compute)
    u = None
    for start in range(0, max(1, x2d.shape[1]), CHUNK_K):
        part = exact_math.dot_rows(xw[:, start:start + CHUNK_K], aw[:, start:start + CHUNK_K])
        u = part if u is None else u + part
    return u


def lora_expand_reference(base: torch.Tensor, u: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                          sizes: tuple[int, ...], scalings: tuple[float, ...], out: torch.Tensor) -> torch.Tensor:
    """The expand on CPU: the rank loop in order, element-wise, then PEFT's add."""
    compute = u.dtype
    rank, col = b.shape[1], 0
    update = torch.empty(base.shape, dtype=compute)
    for g, (size, scaling) in enumerate(zip(sizes, scalings)):
        acc = torch.zeros(base.shape[0], size, dtype=compute)
        bw = b[col:col + size].to(compute)
        for j in range(rank):
            acc = acc + u[:, g * rank + j, None] * bw[None, :, j]
        if bias is not None:
            acc = acc + bias[col:col + size].to(compute)
        update[:, col:col + size] = acc * scaling
        col += size
    out.copy_((base.to(compute) + update).to(out.dtype))
    return out
