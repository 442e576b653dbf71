"""Projection fusion for rollouts: the q/k/v (or gate/up) projections that read one input run
as one GEMM when their weights, and biases, are consecutive rows of one buffer.

`fuse_linears` moves a group's parameters into one buffer (the parameters stay the same
objects, now views of it); `grouped_linear` is how the layers apply a group: one GEMM over the
fused buffers when no gradient is needed, the separate GEMMs otherwise, bitwise the same
numbers either way (docs/design.md rule 1). `fuse_projections` fuses every group a model
declares (``projection_groups()``); the runtime calls it when an engine is built.
"""

from __future__ import annotations

import torch
from torch import nn

from vexact_models.kernels import linear, lora_add

from .adapters import add_adapters, base_layer, fuse_adapters, lora_terms, stacked_lora, start_shrinks
from .fused_buffers import fused_view as _fused_view
from .fused_buffers import share_one_buffer as _share_one_buffer
from .side_stream import joined, shrink_beside


def fuse_linears(linears: list[nn.Module]) -> bool:
    """Put the weights of `linears` (same input width, dtype, device; PEFT-wrapped ones count by
    their base layer) in consecutive rows of one buffer, and their biases, when every one has a
    bias, in one bias buffer the same way, so that `grouped_linear` runs them as one GEMM. The
    parameters stay what they were (same objects, names, values; ``.data`` becomes a view of
    the buffer), so checkpoints, optimizers and the training forward are unaffected. A group
    mixing biased and bias-free layers is not fused (a zero bias would turn -0.0 outputs into
    +0.0). The members' LoRA adapters are fused the same way (`adapters.fuse_adapters`).
    Returns whether fused."""
    bases = [base_layer(lin) for lin in linears]
    weights = [lin.weight for lin in bases]
    biases = [lin.bias for lin in bases]
    first = weights[0]
    if any(w.dim() != 2 or w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device
           or w.device.type == "meta" for w in weights):
        return False
    if any(b is not None for b in biases) and (any(b is None for b in biases) or any(
            b.dim() != 1 or b.shape[0] != w.shape[0] or b.dtype != biases[0].dtype or b.device != first.device
            for b, w in zip(biases, weights))):
        return False
    _share_one_buffer(weights)
    if biases[0] is not None:
        _share_one_buffer(biases)
    fuse_adapters(linears)
    return True


_fused_weight = _fused_view  # the name tests/distributed uses to check that fused groups survive sleep


def _fused_operands(weights: list[torch.Tensor],
                    biases: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight view, bias view or None)`` of a group fused by `fuse_linears`, else None (also
    when only the weights are fused: the biases were replaced since, or some layers have none)."""
    weight = _fused_view(weights)
    if weight is None or all(b is None for b in biases):
        return None if weight is None else (weight, None)
    bias = None if any(b is None for b in biases) else _fused_view(biases)
    return None if bias is None else (weight, bias)


def grouped_linear(x: torch.Tensor, linears: list[nn.Module]) -> list[torch.Tensor]:
    """Each of `linears` applied to `x` (PEFT LoRA adapters included, see `adapters`). When
    their base weights and biases are fused (`fuse_linears`) and no gradient flows into them,
    one GEMM computes all base outputs: bitwise the same numbers, because `kernels.linear`
    computes every output element the same way whatever N or the tile
    (conformance/kernel_invariance.py checks tile configs against each other) and adds the bias
    to each output element on its own, after the K reduction. Otherwise the separate GEMMs run.
    Adapter updates follow: on the fused output, one `kernels.lora_add` over the group's stacked
    adapters when they are fused (`adapters.stacked_lora`: bitwise the members' separate
    updates), else each member's own (`add_adapters`); in a CUDA-graph capture their shrinks
    begin on the side stream before the base GEMM (`side_stream.shrink_beside`: the same
    launches). The outputs may be column slices of one tensor."""
    bases = [base_layer(lin) for lin in linears]
    weights = [lin.weight for lin in bases]
    biases = [lin.bias for lin in bases]
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(
        t is not None and t.requires_grad for t in weights + biases))
    fused = None if needs_grad else _fused_operands(weights, biases)
    if fused is not None:
        stacked = stacked_lora(linears)
        # one shrink, one expand for the whole group (adapters in training: each member's, with gradients)
        if stacked is not None and not (torch.is_grad_enabled() and stacked.trainable):
            started = shrink_beside(x, stacked.a)  # in a capture: beside the base GEMM
            out = linear(x, *fused)
            lora_add(out, x, stacked.a, stacked.b, stacked.scalings, bias=stacked.bias, sizes=stacked.sizes,
                     inplace=True, partials=joined(started))
            return list(out.split(stacked.sizes, dim=-1))
        terms = [lora_terms(lin) for lin in linears]
        started = [start_shrinks(x, t) for t in terms]
        out = linear(x, *fused)
        outs = list(out.split([w.shape[0] for w in weights], dim=-1))
    else:
        terms, started = [None] * len(linears), [None] * len(linears)
        outs = [linear(x, lin.weight, lin.bias) for lin in bases]
    return [add_adapters(out, x, lin, terms=t, started=early)
            for out, lin, t, early in zip(outs, linears, terms, started)]


def fused_bias_free_weight(x: torch.Tensor, linears: list[nn.Module]) -> torch.Tensor | None:
    """The ``[sum N, K]`` view of `linears`' weights when `grouped_linear` would run them as one
    GEMM and nothing is added to its output: fused by `fuse_linears`, no bias, no active PEFT
    adapter, no gradient flowing into them. Else None. What an op that consumes the fused GEMM's
    output inside its own launch (`kernels.linear_silu_and_mul`) needs."""
    bases = [base_layer(lin) for lin in linears]
    weights = [lin.weight for lin in bases]
    # the gradient first: a training forward returns here, before the adapters are looked up
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return None
    if any(lin.bias is not None for lin in bases) or any(lora_terms(lin) for lin in linears):
        return None
    return _fused_view(weights)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every projection group of `model` that reads one input (q/k/v, gate/up; modules
    that define ``projection_groups()``) for one-GEMM inference. Returns the groups fused."""
    fused = 0
    for module in model.modules():
        groups = getattr(module, "projection_groups", None)
        if callable(groups):
            fused += sum(fuse_linears(group) for group in groups())
    return fused


def randomize_projection_biases(model: nn.Module, seed: int = 0) -> None:
    """Give every projection bias (``*_proj.bias``: q/k/v/o, gate/up/down) random values, about as
    large as the projection's output (std ``initializer_range * sqrt(in_features)``): HF's
    random init zeroes biases, which would leave the biased GEMMs (and their fusion) unexercised.
    An `Architecture.init_for_conformance` hook; works on stock transformers models too (by name)."""
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, module in model.named_modules():
            bias = getattr(module, "bias", None)
            if isinstance(module, nn.Linear) and bias is not None and name.rsplit(".", 1)[-1].endswith("_proj"):
                bias.copy_(torch.randn(bias.shape, generator=gen) * std * module.in_features ** 0.5)
