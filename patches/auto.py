"""Route transformers' Auto classes to our architectures.

After `patch()`, for a checkpoint whose ``model_type`` we support, ``AutoModelForCausalLM``
(``from_pretrained`` / ``from_config``) returns our training variant, ``AutoModel`` our base
model, and ``AutoModelForSequenceClassification`` / ``AutoModelForTokenClassification`` our
heads where the architecture has them (otherwise HF's heads, which build their body through
``AutoModel`` and so get our base model). The same classes also replace stock's under their
names in the ``transformers`` namespace (``transformers.Qwen3ForCausalLM``), which is where a
loader that picks the class named by a checkpoint's ``config.architectures`` looks: TRL's
trainers given a checkpoint path (``getattr(transformers, config.architectures[0])``). A name
bound earlier (``from transformers import Qwen3ForCausalLM`` before `patch()`) keeps stock's
class. Unsupported model types, and classes we do not serve (Qwen3.5's
``...ForConditionalGeneration``), stay stock. For architectures with ``checkpoint_conversions``,
transformers' own conversion of published layouts (per-expert hub MoE checkpoints) is registered
for our classes too (`checkpoints.register_conversions`). `unpatch()` restores exactly what was there before, Auto
mappings, ``transformers`` names and conversion registry. Idempotent both ways. Works on every
transformers release from 5.2 on (see `patches.compat.route` for why the mapping is written
directly).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
                                                    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING, MODEL_MAPPING)

from vexact_models.registry import architectures

from .checkpoints import conversion_model_types, register_conversions
from .compat import configs_given_the_same_class, route, routed_class, transformers_namespaces, unroute

# (id(mapping), config class) -> (mapping, what the mapping's registrations held before patch())
_saved: dict[tuple[int, type], tuple[object, object]] = {}
# (a transformers module object, a name in it, stock's class there before patch(), ours bound to it)
_saved_names: list[tuple[object, str, type, type]] = []
# what undoes patch()'s checkpoint-conversion registrations, in the order they were made
_conversion_undos: list[Callable[[], None]] = []


def _registered_targets() -> Iterator[tuple[object, type, type]]:
    """(Auto mapping, config class, our class) for every registered architecture."""
    for arch in architectures():
        yield MODEL_FOR_CAUSAL_LM_MAPPING, arch.config_class, arch.causal_lm_class
        yield MODEL_MAPPING, arch.config_class, arch.base_model_class
        if arch.sequence_classification_class is not None:
            yield MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, arch.config_class, arch.sequence_classification_class
        if arch.token_classification_class is not None:
            yield MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING, arch.config_class, arch.token_classification_class


def _targets() -> Iterator[tuple[object, type, type]]:
    """`_registered_targets`, and for each the other config classes stock's mapping gives the same
    stock class (`compat.configs_given_the_same_class`: Qwen3.5's multimodal configs), so that
    ours replaces stock's wherever the Auto class would build it."""
    for mapping, config_class, ours in _registered_targets():
        yield mapping, config_class, ours
        for other in configs_given_the_same_class(mapping, config_class):
            yield mapping, other, ours


def _exported_names(targets: list[tuple[object, type, type]]) -> list[tuple[str, type, type]]:
    """(name, stock's class, our class) for each target whose Auto mapping gives a stock class
    that ``transformers`` exports under that class's name."""
    names = []
    for mapping, config_class, ours in targets:
        stock = routed_class(mapping, config_class)
        if stock is not None and getattr(sys.modules["transformers"], stock.__name__, None) is stock:
            names.append((stock.__name__, stock, ours))
    return names


def _bind_names(names: list[tuple[str, type, type]]) -> None:
    """Bind each name to our class in every ``transformers`` module object where it is stock's
    (`compat.transformers_namespaces`), keeping what undoes it in `_saved_names`."""
    for namespace in transformers_namespaces() if names else []:
        for name, stock, ours in names:
            if getattr(namespace, name, None) is stock:
                _saved_names.append((namespace, name, stock, ours))
                setattr(namespace, name, ours)


def patch() -> None:
    """Make the Auto classes return vexact-models classes for every registered architecture (and
    the ``transformers`` names of the stock classes they replace be ours), and let transformers
    convert published checkpoint layouts for those with ``checkpoint_conversions``."""
    targets = list(_targets())
    for mapping, config_class, ours in _registered_targets():
        owner = getattr(ours, "config_class", config_class)
        if owner is not config_class:  # checked for all before anything changes
            raise ValueError(f"patch(): {ours.__name__}.config_class is {owner.__name__}, but its architecture "
                             f"registers it for {config_class.__name__}")
    # stock's classes, looked up before any routing, for the targets a patch() has not routed yet
    names = _exported_names([t for t in targets if (id(t[0]), t[1]) not in _saved])
    for mapping, config_class, ours in targets:
        previous = route(mapping, config_class, ours)
        _saved.setdefault((id(mapping), config_class), (mapping, previous))
    _bind_names(names)
    # a second patch() finds its model types registered already and adds nothing to undo
    _conversion_undos.append(register_conversions(conversion_model_types(architectures())))


def unpatch() -> None:
    """Restore the Auto classes, the ``transformers`` names `patch()` bound (unless rebound since)
    and transformers' checkpoint-conversion registry to what they were before `patch()`."""
    for (_, config_class), (mapping, previous) in list(_saved.items()):
        unroute(mapping, config_class, previous)
    _saved.clear()
    for namespace, name, stock, ours in _saved_names:
        if getattr(namespace, name, None) is ours:  # a name rebound since is left as it is now
            setattr(namespace, name, stock)
    _saved_names.clear()
    while _conversion_undos:
        _conversion_undos.pop()()


def is_patched() -> bool:
    """True when every registered architecture's Auto classes resolve to our classes (checked
    through the lookup the Auto classes themselves perform), and so do the ``transformers`` names
    `patch()` bound."""
    return (all(routed_class(mapping, config_class) is ours for mapping, config_class, ours in _targets())
            and all(getattr(namespace, name, None) is ours for namespace, name, _, ours in _saved_names))
