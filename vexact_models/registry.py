"""The architecture registry: what `patch()` installs and the conformance suite checks.

Each architecture registers itself (see ``vexact_models/qwen3/__init__.py``); the conformance
suite iterates over `architectures()`, so a new architecture is checked without editing it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

_BUILTIN = ("vexact_models.qwen3", "vexact_models.qwen3_moe", "vexact_models.deepseek_v3", "vexact_models.moonlight")
_REGISTRY: dict[str, "Architecture"] = {}


@dataclass(frozen=True)
class Architecture:
    """One supported architecture.

    Attributes:
        name: short name (``"qwen3"``).
        model_types: HF ``config.model_type`` values it serves.
        config_class: HF config class.
        causal_lm_class: our training variant (returned by ``AutoModelForCausalLM`` after patch()).
        base_model_class: our base model (returned by ``AutoModel``).
        inference_class: our inference variant.
        tiny_config: builds a tiny random-weight config for CPU tests (kwargs override fields).
        hf_causal_lm_class: dotted path of the stock transformers class, for HF parity.
        published_configs: file names under ``shared/configs`` with the real shapes.
        init_for_conformance: ``fn(model, seed)`` giving random values to what random init leaves
            constant and the forward depends on (e.g. DeepSeek's expert-selection bias), so that
            conformance exercises it; None when there is nothing to do.
        sequence_classification_class: our reward-model / critic head, returned by
            ``AutoModelForSequenceClassification`` after patch() (None: HF's head, over our base
            model, which it builds through ``AutoModel``).
        token_classification_class: our per-token head, returned by
            ``AutoModelForTokenClassification`` after patch() (None: as above).
    """

    name: str
    model_types: tuple[str, ...]
    config_class: type
    causal_lm_class: type
    base_model_class: type
    inference_class: type
    tiny_config: Callable[..., object]
    hf_causal_lm_class: str
    published_configs: tuple[str, ...] = field(default_factory=tuple)
    init_for_conformance: Callable[..., None] | None = None
    sequence_classification_class: type | None = None
    token_classification_class: type | None = None

    def hf_class(self) -> type:
        module, _, name = self.hf_causal_lm_class.rpartition(".")
        return getattr(importlib.import_module(module), name)


def register(arch: Architecture) -> Architecture:
    """Add (or replace) an architecture; returns it."""
    _REGISTRY[arch.name] = arch
    return arch


def _load_builtin() -> None:
    for module in _BUILTIN:
        importlib.import_module(module)


def architectures() -> list[Architecture]:
    """All registered architectures (built-in ones are imported on first call)."""
    _load_builtin()
    return list(_REGISTRY.values())


def get(name: str) -> Architecture:
    """The architecture called `name`, or a ValueError listing the known names."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown architecture {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def for_model_type(model_type: str) -> Architecture | None:
    """The architecture serving HF ``model_type``, if any."""
    _load_builtin()
    for arch in _REGISTRY.values():
        if model_type in arch.model_types:
            return arch
    return None
