"""Route transformers' Auto classes to our architectures.

After `patch()`, ``AutoModelForCausalLM.from_pretrained`` / ``from_config`` on a checkpoint whose
``model_type`` we support returns our training variant, and ``AutoModel`` our base model;
unsupported model types stay stock. `unpatch()` restores exactly what was there before.
Idempotent both ways.
"""

from __future__ import annotations

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

from vexact_models.registry import architectures

_MISSING = object()
# (mapping, config class) -> what _extra_content held before patch() (or _MISSING)
_saved: dict[tuple[int, type], tuple[object, object]] = {}


def _targets():
    for arch in architectures():
        yield MODEL_FOR_CAUSAL_LM_MAPPING, arch.config_class, arch.causal_lm_class
        yield MODEL_MAPPING, arch.config_class, arch.base_model_class


def patch() -> None:
    """Make the Auto classes return vexact-models classes for every registered architecture."""
    for mapping, config_class, ours in _targets():
        key = (id(mapping), config_class)
        if key not in _saved:
            _saved[key] = (mapping, mapping._extra_content.get(config_class, _MISSING))
        mapping.register(config_class, ours, exist_ok=True)


def unpatch() -> None:
    """Restore the Auto classes to what they were before `patch()`."""
    for (_, config_class), (mapping, previous) in list(_saved.items()):
        if previous is _MISSING:
            mapping._extra_content.pop(config_class, None)
        else:
            mapping._extra_content[config_class] = previous
    _saved.clear()


def is_patched() -> bool:
    """True when every registered architecture is routed to our classes."""
    return all(mapping._extra_content.get(config_class) is ours for mapping, config_class, ours in _targets())
