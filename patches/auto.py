"""Route transformers' Auto classes to our architectures.

After `patch()`, for a checkpoint whose ``model_type`` we support, ``AutoModelForCausalLM``
(``from_pretrained`` / ``from_config``) returns our training variant, ``AutoModel`` our base
model, and ``AutoModelForSequenceClassification`` / ``AutoModelForTokenClassification`` our
heads where the architecture has them (otherwise HF's heads, which build their body through
``AutoModel`` and so get our base model). Unsupported model types stay stock. `unpatch()`
restores exactly what was there before. Idempotent both ways. Works on every transformers
release from 5.2 on (see `patches.compat.route` for why the mapping is written directly).
"""

from __future__ import annotations

from collections.abc import Iterator

from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
                                                    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING, MODEL_MAPPING)

from vexact_models.registry import architectures

from .compat import route, routed_class, unroute

# (id(mapping), config class) -> (mapping, what the mapping's registrations held before patch())
_saved: dict[tuple[int, type], tuple[object, object]] = {}


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
    """Make the Auto classes return vexact-models classes for every registered architecture."""
    targets = list(_targets())
    for mapping, config_class, ours in targets:
        owner = getattr(ours, "config_class", config_class)
        if owner is not config_class:  # checked for all before anything changes
            raise ValueError(f"patch(): {ours.__name__}.config_class is {owner.__name__}, but its architecture "
                             f"registers it for {config_class.__name__}")
    for mapping, config_class, ours in targets:
        previous = route(mapping, config_class, ours)
        _saved.setdefault((id(mapping), config_class), (mapping, previous))


def unpatch() -> None:
    """Restore the Auto classes to what they were before `patch()`."""
    for (_, config_class), (mapping, previous) in list(_saved.items()):
        unroute(mapping, config_class, previous)
    _saved.clear()


def is_patched() -> bool:
    """True when every registered architecture's Auto classes resolve to our classes (checked
    through the lookup the Auto classes themselves perform)."""
    return all(routed_class(mapping, config_class) is ours for mapping, config_class, ours in _targets())
