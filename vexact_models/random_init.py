"""Random values for what HF's random init leaves constant, so that a parity check can see it.

HF initialises every norm weight to 1 and every bias to 0. A model built that way cannot tell
two norms apart (a layer that applies the wrong one, or none, computes the same numbers), nor a
bias that is added twice or not at all. `randomize_norms_and_biases` gives each its own random
values; the parity tests (tests/models/model_support.py `stock_model`, the test module
``vexact new-architecture`` writes) apply it before comparing with stock transformers.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import RMSNorm


def is_norm(module: nn.Module) -> bool:
    """A normalisation module, ours or HF's (by class: ``RMSNorm``, ``LayerNorm`` and every
    ``...Norm`` subclass HF names per model, e.g. ``Olmo2RMSNorm``)."""
    return isinstance(module, (RMSNorm, nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


@torch.no_grad()
def randomize_norms_and_biases(model: nn.Module, seed: int = 0) -> int:
    """Give every norm weight values drawn from U(0.5, 1.5) and every bias (a parameter named
    ``bias``: linear layers' and norms') random values; returns how many tensors changed.

    A linear layer's bias gets std ``initializer_range * sqrt(in_features)`` (about as large as
    the layer's output, as `projections.randomize_projection_biases` does); a norm's bias std
    0.1. Works on our models and on stock transformers models alike (module names and classes
    only), so either side of a parity check can be randomised and the weights copied across.
    """
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02))
    changed = 0
    for module in model.modules():
        norm = is_norm(module)
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if norm and isinstance(weight, nn.Parameter):
            weight.copy_(torch.rand(weight.shape, generator=gen) + 0.5)
            changed += 1
        if isinstance(bias, nn.Parameter):
            scale = std * module.in_features ** 0.5 if isinstance(module, nn.Linear) else 0.1
            bias.copy_(torch.randn(bias.shape, generator=gen) * scale)
            changed += 1
    return changed


def randomize_router_bias(model: nn.Module, seed: int = 0, std: float = 0.05) -> None:
    """Give every router's ``e_score_correction_bias`` random values (random init leaves it at
    zero, which would not exercise the bias-corrected selection). Works on stock models too."""
    gen = torch.Generator().manual_seed(seed)
    for name, bias in model.named_buffers():  # by name: works on stock transformers models too
        if name.endswith("e_score_correction_bias"):
            bias.copy_(torch.randn(bias.shape, generator=gen) * std)
