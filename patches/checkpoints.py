"""Checkpoint-name mapping: let our classes load every checkpoint layout stock HF loads.

transformers converts some published layouts at load time (e.g. Qwen3-MoE and DeepSeek-V3 hub
checkpoints store one tensor per expert, ``mlp.experts.<e>.gate_proj.weight``..., which it fuses
into ``mlp.experts.gate_up_proj [E, 2I, H]``) and reverses the conversion on save. From 5.13 it
applies those conversions only to its own classes, or to model types registered by the user
(`compat.register_conversion`); so HF's own mapping is registered for the model types of every
architecture with ``checkpoint_conversions=True``: by `patch()` until `unpatch()` (which
restores transformers' registry as it was), and by our classes' own ``from_pretrained`` /
``save_pretrained`` for the duration of the call (`checkpoint_conversions`), so that loading a
hub checkpoint through our classes directly works without `patch()` and changes nothing global.
Stock classes are unaffected.

When one expert's tensor is missing or mis-shaped, transformers' conversion fails with an error
about the fused target (``mlp.experts.gate_up_proj``) and prints the per-expert detail only in
its load report; `check_expert_tensors` reads the checkpoint's headers first and names the tensor.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from vexact_models.loading import CheckpointError, listed

from .compat import register_conversion

#: One expert's tensor in the hub layout: ``<prefix>.experts.<e>.<proj>.weight``.
_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def conversion_model_types(architectures: Iterable) -> list[str]:
    """The model types of the `architectures` (registry entries) with ``checkpoint_conversions``."""
    return [t for arch in architectures if arch.checkpoint_conversions for t in arch.model_types]


def register_conversions(model_types: Iterable[str]) -> Callable[[], None]:
    """Register transformers' own checkpoint conversion for each of `model_types` for our classes
    (`compat.register_conversion`); returns one function undoing all of it, in reverse order."""
    undos = [undo for undo in map(register_conversion, model_types) if undo is not None]

    def undo_all() -> None:
        for undo in reversed(undos):
            undo()

    return undo_all


@contextmanager
def checkpoint_conversions(model_class: type) -> Iterator[None]:
    """transformers' checkpoint conversions for `model_class`'s architecture, registered for the
    duration of the block (a ``from_pretrained`` or ``save_pretrained`` of that class) and then
    removed; nothing when the class's architecture needs none or they are registered already."""
    from vexact_models.registry import for_model_type

    arch = for_model_type(getattr(model_class.config_class, "model_type", ""))
    undo = register_conversions(conversion_model_types([arch] if arch is not None else []))
    try:
        yield
    finally:
        undo()


def expert_tensor_shapes(config) -> tuple[int, dict[str, tuple[int, int]]] | None:
    """``(experts, {projection: shape})`` of one routed expert's hub-layout tensors for an MoE
    `config`; None for a dense model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    inter, hidden = getattr(config, "moe_intermediate_size", None), getattr(config, "hidden_size", None)
    if not experts or not inter or not hidden:
        return None
    return int(experts), {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def _variant(name: str, variant: str | None) -> str:
    """transformers' file naming for a `variant` (``model.safetensors`` -> ``model.fp16.safetensors``)."""
    if not variant:
        return name
    parts = name.split(".")
    return ".".join(parts[:-1] + [variant] + parts[-1:])


def checkpoint_shapes(folder: str, variant: str | None = None) -> dict[str, tuple[int, ...]] | None:
    """Every tensor name and shape of the safetensors checkpoint in `folder` (single file or
    sharded with an index), read from the file headers alone; None when there is none."""
    from safetensors import safe_open

    index = os.path.join(folder, _variant("model.safetensors.index.json", variant))
    single = _variant("model.safetensors", variant)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, single)):
        files = [single]
    else:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def expert_tensor_errors(shapes: dict[str, tuple[int, ...]], config) -> tuple[list[str], list[str]]:
    """``(missing, wrong)`` for the hub-layout experts of a checkpoint (`shapes`: name ->
    shape): every ``<prefix>.experts`` that holds any per-expert tensor must hold experts
    ``0..E-1``, each with gate/up/down of the config's shapes. `wrong` are sentences."""
    expected = expert_tensor_shapes(config)
    if expected is None:
        return [], []
    experts, want = expected
    found: dict[str, dict[tuple[int, str], tuple[int, ...]]] = {}
    wrong = []
    for name, shape in shapes.items():
        match = _EXPERT_KEY.match(name)
        if match is None:
            continue
        expert, proj = int(match["expert"]), match["proj"]
        if expert >= experts:
            wrong.append(f"{name} is for expert {expert}, but the config has {experts} experts (0..{experts - 1})")
        elif tuple(shape) != want[proj]:
            wrong.append(f"{name} has shape {tuple(shape)} but the model expects {want[proj]}")
        found.setdefault(match["prefix"], {})[(expert, proj)] = shape
    missing = [f"{prefix}.{e}.{proj}.weight" for prefix in sorted(found) for e in range(experts)
               for proj in _PROJECTIONS if (e, proj) not in found[prefix]]
    return missing, wrong


def check_expert_tensors(model_class: type, args: tuple, kwargs: dict) -> None:
    """For ``model_class.from_pretrained(*args, **kwargs)`` of a local folder holding a
    hub-layout MoE checkpoint: raise `CheckpointError` (a RuntimeError, as transformers' failed
    conversion is, and a ValueError) naming every missing or mis-shaped per-expert tensor (before
    anything is loaded). Hub ids and other formats are left to transformers."""
    path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return
    folder = os.path.join(path, kwargs.get("subfolder") or "")
    config = kwargs.get("config")
    if config is None or isinstance(config, (str, os.PathLike)):
        source = folder if config is None else config
        if not os.path.isfile(os.path.join(source, "config.json")):
            return
        # the config class, not the raw json: field names differ across versions (num_experts
        # is saved as num_local_experts by newer transformers; attribute_map reads both)
        config = model_class.config_class.from_pretrained(source)
    owner = model_class.__name__
    if expert_tensor_shapes(config) is None:
        return
    shapes = checkpoint_shapes(folder, kwargs.get("variant"))
    if shapes is None:
        return
    missing, wrong = expert_tensor_errors(shapes, config)
    if missing:
        raise CheckpointError(f"{owner}.from_pretrained: the checkpoint is missing tensor(s) {listed(missing)} (one "
                              "tensor per expert: every MoE layer needs each expert's gate_proj, up_proj and down_proj)")
    if wrong:
        raise CheckpointError(f"{owner}.from_pretrained: checkpoint tensor(s) that do not fit the config: "
                              f"{listed(wrong, joined=True)}")
