"""linear_silu_and_mul: ``silu_and_mul(gate, up)`` of ``gate, up = linear(x, weight).split(I)``,
the gated MLP's activation straight from its fused ``[gate; up]`` weight.

Invariance contract: bitwise the composition of `linear` and `silu_and_mul`, whichever launch
runs (docs/design.md rules 1 and 5). Where a gradient is needed, on CPU and wherever the fused
launch does not apply, it *is* that composition. Inside a CUDA-graph capture on Hopper with the
optional quack-kernels package (``VEXACT_LINEAR=auto``, the rollout engine's decode steps), it is
one quack GEMM whose epilogue computes `silu_and_mul`'s instructions on the rounded halves
(`linear_silu_and_mul_quack`): one launch and one ``[T, 2I]`` round trip fewer per layer.
"""

from __future__ import annotations

import torch

from . import linear_silu_and_mul_quack
from .backend import select
from .linear import linear
from .silu_and_mul import silu_and_mul


def linear_silu_and_mul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The two ops it equals: `linear` over the fused weight, then `silu_and_mul` on the halves."""
    gate, up = linear(x, weight).split(weight.shape[0] // 2, dim=-1)
    return silu_and_mul(gate, up)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(x @ W_gate.T) * (x @ W_up.T)`` with ``weight = [W_gate; W_up]`` (``[2I, K]``, the
    fused gate/up buffer of `projections.fuse_linears`), rounded as `linear` then `silu_and_mul`
    round it.

    Args:
        x: ``[..., K]`` activations, the dtype of `weight`.
        weight: ``[2I, K]``: the gate rows, then the up rows.
    Returns:
        ``[..., I]`` in `x`'s dtype. Differentiable (through the two ops) where a gradient is needed.
    """
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"linear_silu_and_mul: weight shape {tuple(weight.shape)} must be [2I, K] "
                         f"(gate rows then up rows), an even number of rows")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_silu_and_mul: x has {x.shape[-1]} features but weight expects {weight.shape[1]}")
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not needs_grad and x.is_cuda and weight.dtype == x.dtype and select("linear", x, fast=True) == "triton":
        x2d = x.reshape(-1, x.shape[-1])
        config = linear_silu_and_mul_quack.choose(x2d, weight) if x2d.stride(-1) == 1 else None
        if config is not None:
            out = linear_silu_and_mul_quack.linear_silu_and_mul_quack(x2d, weight, config)
            return out.reshape(*x.shape[:-1], weight.shape[0] // 2)
    return linear_silu_and_mul_reference(x, weight)
