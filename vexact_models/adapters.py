"""PEFT adapters under the aligned kernels.

PEFT's ``get_peft_model`` replaces a targeted ``nn.Linear`` with a ``peft.tuners.lora.Linear``
that wraps it (``base_layer``) and adds ``lora_B(lora_A(dropout(x))) * scaling`` with torch's
own GEMMs. Our forward never calls a projection module: it reads weights and runs
`kernels.linear`, so that training and rollouts compute every row the same way (docs/design.md
rule 1). This module is how the forward sees through PEFT's wrappers: the base weight of a
wrapped linear, and the adapters' update added by `kernels.lora_add` (the shrink ``x A^T`` with
bf16 operands and fp32 accumulation in fixed K chunks, the expand ``. B^T`` (+ B's bias) in
fp32, times scaling, added to the base output in PEFT's order). Both the training forward and
the runtime call it, so rollouts with adapters equal ``token_logprobs`` bitwise. A fused
projection group (q/k/v, gate/up) whose members carry one adapter of one rank has its A and B
matrices fused too (`fuse_adapters`, the views `stacked_lora` reads): one shrink over the
stacked A's and one expand into the group's fused output, bitwise the members' separate calls
(the kernel's contract). What it cannot compute the same way on both paths is an error naming
the feature, never silently skipped (an `UnsupportedAdapter`, which the decoder stack's forward
names by the module's path, ``layers.0.self_attn.q_proj``). Adapters on fused expert tensors (PEFT's
``target_parameters``, one ``ParamWrapper`` per adapted tensor) are found by `expert_adapters`
and added by `kernels.fused_moe` over its expert-sorted rows (`kernels/moe_lora.py`), instead of
PEFT's effective weight ``W + scaling B A`` rebuilt for the whole expert stack on every forward.

peft itself is imported only when a PEFT layer is met: it stays an optional dependency.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vexact_models.kernels import ExpertLora, linear, lora_add

from .fused_buffers import fused_view, share_one_buffer
from .side_stream import joined, shrink_beside


class UnsupportedAdapter(ValueError):
    """A PEFT layer or adapter that the aligned forward cannot compute as PEFT does, raised with
    the `module` it sits on. The module does not know its own name, so the message starts with
    `where` (the caller's name for it, or its class); the decoder stack's forward re-raises it
    named by the module's path in the model (`at`)."""

    def __init__(self, module: nn.Module, where: str, problem: str, tensor: str = "") -> None:
        self.module, self.problem, self.tensor = module, problem, tensor
        super().__init__(f"{where}{'.' + tensor if tensor else ''}: {problem}")

    def at(self, root: nn.Module) -> UnsupportedAdapter:
        """The same error, named by the module's path under `root` (itself where `root` does not
        hold the module)."""
        for path, module in root.named_modules():
            if module is self.module:
                return UnsupportedAdapter(self.module, path, self.problem, self.tensor)
        return self


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
        raise UnsupportedAdapter(module, name, f"PEFT layer {type(module).__module__}.{type(module).__name__} is not "
                                 "supported by vexact-models' aligned forward; only LoRA on linear layers "
                                 "(peft.tuners.lora.Linear) is")
    if module.disable_adapters:
        if module.merged:
            module.unmerge()
        return []
    if module.merged:
        return []
    if getattr(module, "fan_in_fan_out", False):
        raise UnsupportedAdapter(module, name, "LoRA with fan_in_fan_out=True is not supported (the base layer is an "
                                 "nn.Linear)")
    terms = []
    for adapter in module.active_adapters:
        if adapter not in module.lora_A:
            continue
        variant = module.lora_variant.get(adapter)
        if variant is not None:
            raise UnsupportedAdapter(module, name, f"adapter {adapter!r} uses the LoRA variant {type(variant).__name__} "
                                     "(DoRA, aLoRA, ...), which vexact-models' aligned forward does not support; "
                                     "use plain LoRA")
        terms.append(LoraTerm(module.lora_A[adapter], module.lora_B[adapter], module.lora_dropout[adapter],
                              module.scaling[adapter]))
    return terms


def add_adapters(result: torch.Tensor, x: torch.Tensor, module: nn.Module, where: str = "",
                 terms: list[LoraTerm] | None = None, started: list | None = None) -> torch.Tensor:
    """``result`` (the base layer's output for `x`) plus every active LoRA update of `module`, in
    PEFT's order, each added by `kernels.lora_add` (in place when no gradient flows: `result` may
    be a column slice of a fused group's output). `terms`: `module`'s `lora_terms` when the caller
    has them already; `started`: per term, its shrink begun before the base GEMM
    (`start_shrinks`), or None."""
    terms = lora_terms(module, where) if terms is None else terms
    for term, early in zip(terms, started or [None] * len(terms)):
        result = lora_add(result, term.dropout(x), term.lora_a.weight, term.lora_b.weight, (term.scaling,),
                          bias=term.lora_b.bias, inplace=not _needs_grad(result, x, term), partials=joined(early))
    return result


def start_shrinks(x: torch.Tensor, terms: list[LoraTerm]) -> list | None:
    """Each of `terms`' shrinks (a module's `lora_terms`) begun on the side stream before the base
    GEMM runs (`side_stream.shrink_beside`: only inside a CUDA-graph capture without autograd, with
    pass-through dropout), for `add_adapters`; None where none begins."""
    started = [shrink_beside(x, term.lora_a.weight) if _inert(term.dropout) else None for term in terms]
    return started if any(s is not None for s in started) else None


def _needs_grad(result: torch.Tensor, x: torch.Tensor, term: LoraTerm) -> bool:
    return torch.is_grad_enabled() and (result.requires_grad or x.requires_grad or any(
        p is not None and p.requires_grad for p in (term.lora_a.weight, term.lora_b.weight, term.lora_b.bias)))


@dataclass(frozen=True)
class StackedLora:
    """The one active adapter of every member of a projection group, fused (`fuse_adapters`):
    `kernels.lora_add`'s operands for the group's fused output."""

    a: torch.Tensor  # [members * r, K]
    b: torch.Tensor  # [sum N, r]
    bias: torch.Tensor | None  # [sum N] or None
    sizes: tuple[int, ...]
    scalings: tuple[float, ...]
    trainable: bool  # some member's A, B or bias requires a gradient (the views carry none: add per member)


def _inert(dropout: nn.Module) -> bool:
    """True when `dropout` passes x through (PEFT's Identity, or dropout in eval mode / p=0)."""
    return isinstance(dropout, nn.Identity) or not dropout.training or getattr(dropout, "p", 1.0) == 0.0


def stacked_lora(linears: list[nn.Module]) -> StackedLora | None:
    """The group's adapters as one `StackedLora` when every member carries exactly one active
    LoRA adapter, the same one at the same rank, with pass-through dropout, and its A, B (and B
    bias) matrices are consecutive views of one buffer each (`fuse_adapters`); else None (then
    each member adds its own, `add_adapters`)."""
    terms = [lora_terms(lin) for lin in linears]
    if any(len(t) != 1 for t in terms) or len(linears) > 4:
        return None
    terms = [t[0] for t in terms]
    if any(not _inert(t.dropout) for t in terms):
        return None
    a = fused_view([t.lora_a.weight for t in terms])
    b = fused_view([t.lora_b.weight for t in terms])
    if a is None or b is None or a.shape[0] != len(terms) * b.shape[1]:
        return None
    biases = [t.lora_b.bias for t in terms]
    bias = None
    if any(x is not None for x in biases):
        bias = None if any(x is None for x in biases) else fused_view(biases)
        if bias is None:
            return None
    trainable = any(p is not None and p.requires_grad
                    for t in terms for p in (t.lora_a.weight, t.lora_b.weight, t.lora_b.bias))
    return StackedLora(a, b, bias, tuple(t.lora_b.weight.shape[0] for t in terms), tuple(t.scaling for t in terms),
                       trainable)


def fuse_adapters(linears: list[nn.Module]) -> int:
    """For each LoRA adapter that every member of `linears` (a fused projection group) carries at
    one rank, dtype and device, put the members' A matrices in consecutive rows of one buffer and
    their B matrices (and B biases, when all have one) likewise, so that `stacked_lora` finds
    them. The parameters stay the same objects, names and values (``.data`` becomes a view), so
    optimizers, ``state_dict`` and PEFT's save and merge are unaffected. Returns the adapters fused."""
    if len(linears) < 2 or not all(is_adapter_layer(lin) and hasattr(lin, "lora_A") for lin in linears):
        return 0
    fused = 0
    for name in linears[0].lora_A:
        if not all(name in lin.lora_A and name in lin.lora_B for lin in linears):
            continue
        a = [lin.lora_A[name].weight for lin in linears]
        b = [lin.lora_B[name].weight for lin in linears]
        if any(t.dim() != 2 or t.shape != a[0].shape or t.dtype != a[0].dtype or t.device != a[0].device
               or t.device.type == "meta" for t in a) or \
                any(t.dim() != 2 or t.shape[1] != b[0].shape[1] or t.dtype != b[0].dtype or t.device != a[0].device
                    for t in b):
            continue
        biases = [lin.lora_B[name].bias for lin in linears]
        if any(x is not None for x in biases) and (any(x is None for x in biases) or any(
                x.dtype != biases[0].dtype or x.device != a[0].device for x in biases)):
            continue
        share_one_buffer(a)
        share_one_buffer(b)
        if biases[0] is not None:
            share_one_buffer(biases)
        fused += 1
    return fused


def apply_linear(x: torch.Tensor, module: nn.Module, where: str = "") -> torch.Tensor:
    """`module` (an ``nn.Linear``, or one wrapped by PEFT LoRA) applied to `x` with the aligned
    kernels: the base layer's GEMM, then the adapters' updates (`add_adapters`; in a CUDA-graph
    capture their shrinks begin beside the GEMM, `start_shrinks`)."""
    base = base_layer(module)
    terms = lora_terms(module, where)
    started = start_shrinks(x, terms)
    return add_adapters(linear(x, base.weight, base.bias), x, module, where, terms, started)


#: PEFT ``target_parameters`` naming both fused expert tensors of every MoE layer (our models and
#: stock's name them alike)
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")


def expert_target_parameters(model: nn.Module) -> list[str] | None:
    """`EXPERT_TARGETS` for a ``LoraConfig(target_parameters=...)`` when `model` has fused
    (3-D) expert tensors, else None (PEFT's default: no parameter targeted)."""
    fused = any(name.endswith("experts.gate_up_proj") and param.dim() == 3 for name, param in model.named_parameters())
    return list(EXPERT_TARGETS) if fused else None


def expert_adapters(module: nn.Module, where: str = "experts") -> tuple[nn.Module, dict[str, ExpertLora]]:
    """``(experts, adapters)``: the fused experts module under PEFT's ``ParamWrapper`` layers
    (nested, one per adapted tensor; `module` itself when none) and, per wrapped parameter name,
    the one active LoRA adapter a forward must add, as `kernels.moe_lora.ExpertLora` (PEFT's
    ``lora_A``/``lora_B`` weights, read in place). Follows ``ParamWrapper.forward``: nothing for
    a wrapper whose adapters are disabled (unmerging first) or merged. Raises `UnsupportedAdapter`
    for other PEFT layer types, LoRA variants and more than one active adapter on one tensor."""
    adapters: dict[str, ExpertLora] = {}
    while is_adapter_layer(module):
        from peft.tuners.lora import ParamWrapper

        if not isinstance(module, ParamWrapper):
            raise UnsupportedAdapter(module, where, f"PEFT layer {type(module).__module__}.{type(module).__name__} on "
                                     "fused experts is not supported by vexact-models' aligned forward; only LoRA "
                                     "target_parameters (peft.tuners.lora.ParamWrapper) is")
        name = module.parameter_name
        if module.disable_adapters:
            if module.merged:
                module.unmerge()
        elif not module.merged:
            active = [a for a in module.active_adapters if a in module.lora_A]
            if len(active) > 1:
                raise UnsupportedAdapter(module, where, f"{len(active)} active adapters {active}; vexact-models' "
                                         "aligned experts add one adapter per expert tensor (activate one, or merge "
                                         "the others)", tensor=name)
            for adapter in active:
                if module.lora_variant.get(adapter) is not None:
                    raise UnsupportedAdapter(module, where, f"adapter {adapter!r} uses a LoRA variant, which "
                                             "vexact-models' aligned forward does not support; use plain LoRA",
                                             tensor=name)
                adapters[name] = ExpertLora(module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                                            float(module.scaling[adapter]))
        module = module.base_layer
    return module, adapters


def expert_lora_b(model: nn.Module) -> list[tuple[torch.Tensor, int]]:
    """``(B, experts)`` of every LoRA adapter a forward of `model` adds to a fused expert tensor
    (`expert_adapters`' active, unmerged, enabled ones on 3-D tensors, not a router's): PEFT's
    ``lora_B`` weight ``[N, r * E]`` and the tensor's expert count, found without changing anything.
    What the rollout engine keeps copied by expert (`kernels.KeptExpertB`). Meta tensors (other
    pipeline stages' layers) are left out."""
    found = []
    for module in model.modules():
        if not is_adapter_layer(module) or module.disable_adapters or module.merged:
            continue
        from peft.tuners.lora import ParamWrapper

        tensor = getattr(base_layer(module), module.parameter_name, None) if isinstance(module, ParamWrapper) else None
        if tensor is None or tensor.dim() != 3:  # not an expert tensor (e.g. a router's weight)
            continue
        for name in module.active_adapters:
            if name in module.lora_A and module.lora_variant.get(name) is None and not module.lora_B[name].weight.is_meta:
                found.append((module.lora_B[name].weight, tensor.shape[0]))
    return found


def forbid_adapters(module: nn.Module, where: str, advice: str = "") -> None:
    """Raise a ValueError naming `where` when `module` carries active adapters that the aligned
    forward would not apply (the module's weights are read directly there)."""
    if lora_terms(module, where):  # other PEFT layer types raise in lora_terms
        raise ValueError(f"{where}: PEFT adapters on this module are not supported by vexact-models' aligned forward"
                         + (f"; {advice}" if advice else ""))


def adapter_state(model: nn.Module) -> tuple:
    """What a forward's adapter arithmetic depends on besides tensor values, for every PEFT layer
    of `model`: adapters disabled or merged, the active adapters, their scalings and the storage
    of their and the base layer's weights. A CUDA graph captured under one state replays that
    state's launches; the engine captures again when it changes (runtime/llm.py). Empty without
    PEFT layers."""
    state = []
    for module in model.modules():
        if not is_adapter_layer(module):
            continue
        base = base_layer(module)
        tensors = [getattr(base, "weight", None)] + [
            t for name in module.active_adapters if name in getattr(module, "lora_A", {})
            for t in (module.lora_A[name].weight, module.lora_B[name].weight, module.lora_B[name].bias)]
        state.append((id(module), bool(module.disable_adapters), bool(module.merged), tuple(module.active_adapters),
                      tuple(sorted(getattr(module, "scaling", {}).items())),
                      tuple(None if t is None else t.data_ptr() for t in tensors)))
    return tuple(state)
