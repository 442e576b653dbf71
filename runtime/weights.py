"""The engine's weights: in-place updates (from a dict or a stream) and release while asleep.

`copy_weights` is ``LLM.update_weights``: a mapping is checked whole before the first write; an
iterator (e.g. `vexact_models.distributed.stream_full_weights`) is consumed pair by pair, never
materialised, each pair checked before its copy.

`ReleasedWeights` is what ``LLM.sleep(level=1|2)`` does to weights the engine owns: the
parameters' storages leave the device (level 1 keeps a host copy, level 2 nothing) and come back
at the same layout, so views stay views: the fused q/k/v and gate/up buffers
(`layers.fuse_projections`) are whole storages here, restored whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from vexact_models.adapter_weights import PEFT_PREFIX, AdapterNames


def named_targets(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every name a parameter answers to (HF checkpoint names; a tied weight under each of its
    names: a tied model's ``state_dict()`` lists ``lm_head.weight``)."""
    return dict(model.named_parameters(remove_duplicate=False))


def _check(targets: dict[str, nn.Parameter], name, tensor) -> nn.Parameter:
    if name not in targets:
        raise ValueError(f"LLM.update_weights: unknown parameter {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"LLM.update_weights: {name} is a {type(tensor).__name__}, not a torch.Tensor")
    target = targets[name]
    if target.shape != tensor.shape:
        raise ValueError(f"LLM.update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    if target.is_floating_point() != tensor.is_floating_point():
        raise ValueError(f"LLM.update_weights: {name} has dtype {tensor.dtype}, the parameter is {target.dtype}")
    return target


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank copies the same names in order)."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _pair(pair) -> tuple[str, object]:
    try:
        name, tensor = pair
    except (TypeError, ValueError):
        raise ValueError(f"LLM.update_weights: expected (name, tensor) pairs, got {type(pair).__name__}") from None
    return name, tensor


def _check_adapter(adapters: AdapterNames, name, tensor) -> nn.Parameter | None:
    """The engine's adapter tensor `name` means, checked against `tensor` (shape and dtype exactly:
    an adapter is not cast, the rollout must compute with the trainer's values); None when `name`
    is no adapter tensor of the engine's."""
    if not adapters or not isinstance(name, str):
        return None
    try:
        found = adapters.lookup(name)
    except ValueError as e:
        raise ValueError(f"LLM.update_weights: weights[{name!r}]: {e}") from None
    if found is None:
        if "lora_" in name or "modules_to_save" in name:
            raise ValueError(f"LLM.update_weights: weights[{name!r}] names no adapter tensor of the engine's model "
                             f"(adapters {adapters.adapters}, e.g. {adapters.example()!r})")
        return None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"LLM.update_weights: weights[{name!r}] is a {type(tensor).__name__}, not a torch.Tensor")
    target = found.param
    if target.shape != tensor.shape:
        raise ValueError(f"LLM.update_weights: weights[{name!r}] has shape {tuple(tensor.shape)}; the engine's "
                         f"adapter {found.name} has {tuple(target.shape)}")
    if target.dtype != tensor.dtype:
        raise ValueError(f"LLM.update_weights: weights[{name!r}] has dtype {tensor.dtype}; the engine's adapter "
                         f"{found.name} is {target.dtype} (adapters are copied without a cast, so that rollouts "
                         "compute with the trainer's values: send them in the engine's dtype)")
    return target


@torch.no_grad()
def copy_weights(targets: dict[str, nn.Parameter],
                 weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 written: Callable[[nn.Parameter], None] | None = None,
                 adapters: AdapterNames | None = None) -> int:
    """Copy `weights` into `targets` in place; return the number of tensors copied.

    A mapping is checked whole first (unknown name, wrong shape, non-tensor: ValueError, nothing
    written). Anything else is iterated once, lazily: each pair is checked right before its copy,
    so a bad pair raises having written the pairs before it. `written(param)` is called after
    each copy. Targets on the meta device (the tensors of other pipeline stages) are checked
    but not written, nor counted.

    `adapters` (the engine's PEFT adapter tensors, `vexact_models.adapter_weights`): a pair
    naming one (any of PEFT's names for it) is checked (shape and dtype exactly) and held; the
    held adapters are written only once the whole input is consumed and checked, so an update
    of adapters is all or nothing, from a stream too. Base names behind ``PeftModel``'s prefix
    (``base_model.model.``) are the engine's names without it.
    """
    if isinstance(weights, Mapping):
        for name, tensor in weights.items():
            if _check_adapter(adapters, name, tensor) is None:
                _check(targets, _base_name(targets, name), tensor)
        pairs = iter(weights.items())
    else:
        pairs = iter(weights)
    count, held = 0, {}
    for pair in pairs:
        name, tensor = _pair(pair)
        target = _check_adapter(adapters, name, tensor)
        if target is not None:
            if id(target) in held:
                raise ValueError(f"LLM.update_weights: weights[{name!r}] names the adapter tensor "
                                 f"{held[id(target)][2]!r} named before it: each adapter tensor once per call")
            held[id(target)] = (target, _local(tensor), name)
            continue
        target = _check(targets, _base_name(targets, name), tensor)
        count += _copy(target, tensor, written)
    for target, value, _ in held.values():
        count += _copy(target, value, written)
    return count


def _base_name(targets: dict[str, nn.Parameter], name):
    """`name` without ``PeftModel``'s prefix when that is what the engine knows it by."""
    if isinstance(name, str) and name.startswith(PEFT_PREFIX) and name not in targets:
        return name[len(PEFT_PREFIX):]
    return name


def _copy(target: nn.Parameter, tensor: torch.Tensor, written) -> int:
    value = _local(tensor)  # a DTensor is gathered on every rank, in step, whoever keeps it
    if target.is_meta:  # another pipeline stage's tensor: not held here
        return 0
    target.copy_(value)
    if written is not None:
        written(target)
    return 1


class ReleasedWeights:
    """A model's parameter storages, taken off their device.

    Each distinct storage (a fused projection buffer, a tied weight, a plain parameter) is
    recorded with the parameters viewing it (offset, shape, stride); the parameters then hold
    empty tensors until `restore` gives them a fresh storage of the same size at the same
    layout, filled from the host copy (``keep_copy``) or left uninitialised.
    """

    def __init__(self, params: Iterable[nn.Parameter], keep_copy: bool) -> None:
        self.groups: list[tuple[int, torch.device, list[tuple[nn.Parameter, int, torch.Size, tuple]]]] = []
        self.copies: list[torch.Tensor] | None = [] if keep_copy else None
        by_storage: dict[tuple, int] = {}
        unique = {id(p): p for p in params}.values()
        with torch.no_grad():
            for p in unique:
                storage = p.untyped_storage()
                key = (p.device, storage.data_ptr())
                if key not in by_storage:
                    by_storage[key] = len(self.groups)
                    self.groups.append((storage.nbytes(), p.device, []))
                    if self.copies is not None:
                        pin = p.device.type == "cuda"
                        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                        host.copy_(_as_bytes(storage, p.device))
                        self.copies.append(host)
                self.groups[by_storage[key]][2].append((p, p.storage_offset(), p.shape, p.stride()))
            for _, device, views in self.groups:  # drop every reference to the device storages
                for p, *_ in views:
                    p.data = torch.empty(0, dtype=p.dtype, device=device)
                    p.grad = None

    @property
    def nbytes(self) -> int:
        return sum(n for n, _, _ in self.groups)

    def drop_copy(self) -> None:
        """Forget the host copy (sleep level 2 after level 1)."""
        self.copies = None

    def restore(self) -> list[nn.Parameter]:
        """Give every parameter its storage back; returns the parameters left uninitialised
        (all of them without a host copy, else none)."""
        uninitialised = []
        with torch.no_grad():
            for i, (nbytes, device, views) in enumerate(self.groups):
                storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
                if self.copies is not None:
                    storage.copy_(self.copies[i], non_blocking=True)
                else:
                    uninitialised.extend(p for p, *_ in views)
                for p, offset, shape, stride in views:
                    p.data = torch.empty(0, dtype=p.dtype, device=device).set_(storage.untyped_storage(), offset, shape,
                                                                                stride)
            if self.copies is not None and any(d.type == "cuda" for _, d, _ in self.groups):
                torch.cuda.synchronize()  # the host copies are freed right after
        self.copies = None
        return uninitialised


def _as_bytes(storage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))
