"""PEFT adapters under the aligned kernels.

PEFT's ``get_peft_model`` replaces a targeted ``nn.Linear`` with a ``peft.tuners.lora.Linear``
that wraps it (``base_layer``) and adds ``lora_B(lora_A(dropout(x))) * scaling`` with torch's
own GEMMs. Our forward never calls a projection module: it reads weights and runs
`kernels.linear`, so that training and rollouts compute every row the same way (docs/design.md
rule 1). This module is how the forward sees through PEFT's wrappers: the base weight of a
wrapped linear, and the adapters' update computed with `kernels.linear` in PEFT's own order
(cast x to the adapter dtype, A, B (+ its bias), times scaling, add, cast back). Both the
training forward and the runtime call it, so rollouts with adapters equal ``token_logprobs``
bitwise. What it cannot compute the same way on both paths is an error naming the feature,
never silently skipped.

peft itself is imported only when a PEFT layer is met: it stays an optional dependency.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vexact_models.kernels import linear


@dataclass(frozen=True)
class LoraTerm:
    """One active adapter of a wrapped linear: ``B(A(dropout(x))) * scaling``."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    dropout: nn.Module
    scaling: float


def is_adapter_layer(module: nn.Module) -> bool:
    """True for a PEFT tuner layer (it wraps a ``base_layer`` and knows its active adapters)."""
    # a plain nn.Linear first: the common case, and nn.Module's hasattr fallback is slow on this
    # path (every projection of every step)
    return type(module) is not nn.Linear and hasattr(module, "base_layer") and hasattr(module, "active_adapters")


def base_layer(module: nn.Module) -> nn.Module:
    """The module under any PEFT wrappers (the module itself when it is not wrapped)."""
    if type(module) is nn.Linear:
        return module
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def lora_terms(module: nn.Module, where: str = "") -> list[LoraTerm]:
    """The adapters a forward through `module` must add, in PEFT's order; [] when none.

    Follows ``peft.tuners.lora.Linear.forward``: nothing while adapters are disabled (unmerging
    first, as PEFT does) or merged into the base weight. Raises ValueError for what the aligned
    forward cannot reproduce: PEFT layer types other than LoRA on a linear layer, LoRA variants
    (DoRA, aLoRA, ...), and ``fan_in_fan_out``.
    """
    if not is_adapter_layer(module):
        return []
    from peft.tuners.lora import Linear as LoraLinear

    name = where or type(module).__name__
    if not isinstance(module, LoraLinear):
        raise ValueError(f"{name}: PEFT layer {type(module).__module__}.{type(module).__name__} is not supported by "
                         "vexact-models' aligned forward; only LoRA on linear layers (peft.tuners.lora.Linear) is")
    if module.disable_adapters:
        if module.merged:
            module.unmerge()
        return []
    if module.merged:
        return []
    if getattr(module, "fan_in_fan_out", False):
        raise ValueError(f"{name}: LoRA with fan_in_fan_out=True is not supported (the base layer is an nn.Linear)")
    terms = []
    for adapter in module.active_adapters:
        if adapter not in module.lora_A:
            continue
        variant = module.lora_variant.get(adapter)
        if variant is not None:
            raise ValueError(f"{name}: adapter {adapter!r} uses the LoRA variant {type(variant).__name__} (DoRA, aLoRA, "
                             "...), which vexact-models' aligned forward does not support; use plain LoRA")
        terms.append(LoraTerm(module.lora_A[adapter], module.lora_B[adapter], module.lora_dropout[adapter],
                              module.scaling[adapter]))
    return terms


def add_adapters(result: torch.Tensor, x: torch.Tensor, module: nn.Module, where: str = "") -> torch.Tensor:
    """``result`` (the base layer's output for `x`) plus every active LoRA update of `module`,
    computed with `kernels.linear` in PEFT's order and returned in ``result``'s dtype."""
    terms = lora_terms(module, where)
    if not terms:
        return result
    dtype = result.dtype
    for term in terms:
        xa = x.to(term.lora_a.weight.dtype)  # PEFT casts the input to the adapter's dtype
        update = linear(linear(term.dropout(xa), term.lora_a.weight), term.lora_b.weight, term.lora_b.bias)
        result = result + update * term.scaling
    return result.to(dtype)


def apply_linear(x: torch.Tensor, module: nn.Module, where: str = "") -> torch.Tensor:
    """`module` (an ``nn.Linear``, or one wrapped by PEFT LoRA) applied to `x` with the aligned
    kernels: the base layer's GEMM, then the adapters' updates."""
    base = base_layer(module)
    return add_adapters(linear(x, base.weight, base.bias), x, module, where)


def forbid_adapters(module: nn.Module, where: str, advice: str = "") -> None:
    """Raise a ValueError naming `where` when `module` carries active adapters that the aligned
    forward would not apply (the module's weights are read directly there)."""
    if lora_terms(module, where):  # other PEFT layer types raise in lora_terms
        raise ValueError(f"{where}: PEFT adapters on this module are not supported by vexact-models' aligned forward"
                         + (f"; {advice}" if advice else ""))
