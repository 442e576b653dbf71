"""PEFT adapter tensors by name: what an adapter-only weight sync sends and writes.

In the RL loop where only LoRA adapters train, the trainer sends the engine its adapters and the
base stays (`vexact_models.distributed.stream_full_weights` with ``adapters_only=True``, then
``LLM.update_weights``). Both sides find the adapters the same way, through PEFT's own modules,
never through the arithmetic that applies them (`vexact_models.adapters`): a LoRA layer's
``lora_A[adapter]`` and ``lora_B[adapter]`` (weight, and ``lora_B``'s bias with
``lora_bias=True``), and a ``modules_to_save`` wrapper's trained copy
(``modules_to_save[adapter]``). So the names are PEFT's, whatever module computes with them:

- ``PeftModel.state_dict()`` / ``named_parameters()``:
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``;
- ``get_peft_model_state_dict(peft_model)`` (the adapter name removed):
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, and
  ``base_model.model.lm_head.weight`` for a ``modules_to_save`` copy of ``lm_head``;
- the model under PEFT (``peft_model.get_base_model()``, what the engine runs), e.g. sharded
  with FSDP2: ``model.layers.0.self_attn.q_proj.lora_A.default.weight``.

`adapter_tensors` lists a model's adapter tensors; `AdapterNames` resolves every name above to
the tensor it means. peft itself is never imported here: the modules are recognised by their
``lora_A`` / ``lora_B`` / ``modules_to_save`` ModuleDicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

#: The prefix ``PeftModel`` puts before the names of the model it wraps.
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterTensor:
    """One adapter tensor of a model: its full name (with the adapter name, as the model's
    ``named_parameters`` gives it), its name without the adapter name (as
    ``get_peft_model_state_dict`` writes it), the adapter it belongs to, and the parameter."""

    name: str
    short_name: str
    adapter: str
    param: nn.Parameter


def _module_dict(module: nn.Module, attr: str) -> nn.ModuleDict | None:
    value = module.__dict__.get("_modules", {}).get(attr)
    return value if isinstance(value, nn.ModuleDict) else None


def _tensors_of(path: str, kind: str, adapters: nn.ModuleDict) -> list[AdapterTensor]:
    out = []
    for adapter, sub in adapters.items():
        for pname, param in sub.named_parameters(remove_duplicate=False):
            full = f"{path}{kind}.{adapter}.{pname}"
            short = f"{path}{pname}" if kind == "modules_to_save" else f"{path}{kind}.{pname}"
            out.append(AdapterTensor(full, short, adapter, param))
    return out


def adapter_tensors(model: nn.Module) -> list[AdapterTensor]:
    """Every PEFT adapter tensor of `model`, in module order: the ``lora_A`` / ``lora_B``
    parameters of each LoRA layer (any PEFT LoRA layer, MoE ``ParamWrapper`` targets included)
    and the parameters of each ``modules_to_save`` copy; [] for a model without adapters. Names
    are relative to `model` (a ``PeftModel``'s start with `PEFT_PREFIX`)."""
    out = []
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        lora_a, lora_b = _module_dict(module, "lora_A"), _module_dict(module, "lora_B")
        if lora_a is not None and lora_b is not None:
            out += _tensors_of(prefix, "lora_A", lora_a) + _tensors_of(prefix, "lora_B", lora_b)
        saved = _module_dict(module, "modules_to_save")
        if saved is not None and hasattr(module, "original_module"):
            out += _tensors_of(prefix, "modules_to_save", saved)
    return out


class AdapterNames:
    """The adapter tensors of a model (the engine's: the model under PEFT) by every name that
    means them: the full name, and the name without the adapter name while the model has one
    adapter only, each also behind `PEFT_PREFIX`."""

    def __init__(self, model: nn.Module) -> None:
        self.tensors = adapter_tensors(model)
        self.adapters = sorted({t.adapter for t in self.tensors})
        self._by_name = {t.name: t for t in self.tensors}
        self._short = {t.short_name: t for t in self.tensors}

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def lookup(self, name: str) -> AdapterTensor | None:
        """The adapter tensor `name` means, or None when it names no adapter tensor (e.g. a base
        weight). Raises ValueError for a name without the adapter name while the model holds
        several adapters (which one is meant cannot be told)."""
        key = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        found = self._by_name.get(key)
        if found is not None:
            return found
        found = self._short.get(key)
        if found is not None and len(self.adapters) > 1:
            raise ValueError(f"{name!r} names no adapter, and the model holds {len(self.adapters)} adapters "
                             f"{self.adapters}; use the full name, e.g. {found.name!r} (PeftModel.state_dict() names)")
        return found

    def example(self) -> str:
        """One full adapter name (for error messages)."""
        return self.tensors[0].name if self.tensors else ""
