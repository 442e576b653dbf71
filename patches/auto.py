"""Route transformers' Auto classes to our architectures.

After `patch()`, for a checkpoint whose ``model_type`` we support, ``AutoModelForCausalLM``
(``from_pretrained`` / ``from_config``) returns our training variant, ``AutoModel`` our base
model, and ``AutoModelForSequenceClassification`` / ``AutoModelForTokenClassification`` our
heads where the architecture has them (otherwise HF's heads, which build their body through
``AutoModel`` and so get our base model). Unsupported model types stay stock. For
architectures with ``checkpoint_conversions``, transformers' own conversion of published layouts
(per-expert hub MoE checkpoints) is registered for our classes too
(`checkpoints.register_conversions`). `unpatch()` restores exactly what was there before, Auto
mappings and conversion registry. Idempotent both ways. Works on every transformers release
from 5.2 on (see `patches.compat.route` for why the mapping is written directly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
                                                    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING, MODEL_MAPPING)

from vexact_models.registry import architectures

from .checkpoints import conversion_model_types, register_conversions
from .compat import route, routed_class, unroute

# (id(mapping), config class) -> (mapping, what the mapping's registrations held before patch())
_saved: dict[tuple[int, type], tuple[object, object]] = {}
# what undoes patch()'s checkpoint-conversion registrations, in the order they were made
_conversion_undos: list[Callable[[], None]] = []


def _targets() -> Iterator[tuple[object, type, type]]:
    """(Auto mapping, config class, our class) for every registered architecture."""
    for arch in architectures():
        yield MODEL_FOR_CAUSAL_LM_MAPPING, arch.config_class, arch.causal_lm_class
        yield MODEL_MAPPING, arch.config_class, arch.base_model_class
        if arch.sequence_classification_class is not None:
            yield MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, arch.config_class, arch.sequence_classification_class
        if arch.token_classification_class is not None:
            yield MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING, arch.config_class, arch.token_classification_class


def patch() -> None:
    """Make the Auto classes return vexact-models classes for every registered architecture, and
    let transformers convert published checkpoint layouts for those with ``checkpoint_conversions``."""
    targets = list(_targets())
    for mapping, config_class, ours in targets:
        owner = getattr(ours, "config_class", config_class)
        if owner is not config_class:  # checked for all before anything changes
            raise ValueError(f"patch(): {ours.__name__}.config_class is {owner.__name__}, but its architecture "
                             f"registers it for {config_class.__name__}")
    for mapping, config_class, ours in targets:
        previous = route(mapping, config_class, ours)
        _saved.setdefault((id(mapping), config_class), (mapping, previous))
    # a second patch() finds its model types registered already and adds nothing to undo
    _conversion_undos.append(register_conversions(conversion_model_types(architectures())))


def unpatch() -> None:
    """Restore the Auto classes and transformers' checkpoint-conversion registry to what they were
    before `patch()`."""
    for (_, config_class), (mapping, previous) in list(_saved.items()):
        unroute(mapping, config_class, previous)
    _saved.clear()
    while _conversion_undos:
        _conversion_undos.pop()()


def is_patched() -> bool:
    """True when every registered architecture's Auto classes resolve to our classes (checked
    through the lookup the Auto classes themselves perform)."""
    return all(routed_class(mapping, config_class) is ours for mapping, config_class, ours in _targets())
