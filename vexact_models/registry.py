"""The architecture registry: what `patch()` installs, the suite checks and packaging ships.

An architecture is a folder ``vexact_models/<name>/`` holding ``modeling.py`` and an
``__init__.py`` that calls `register` (see ``vexact_models/qwen3/__init__.py``, the template
``vexact new-architecture`` copies). Built-in folders are discovered, not listed: every
sub-package with a ``modeling.py`` is imported on first use. Architectures living in other
packages register through the ``vexact_models.architectures`` entry-point group (the value is a
module that calls `register` on import). The conformance suite and the parametrised model tests
iterate over `architectures()` and `shapes()`, so a new architecture is checked without editing them.

Published shapes are data: one architecture serves one set of HF ``model_type`` values, and its
named `Shape` s (e.g. DeepSeek-V3's ``moonlight``) are configs of it, not further architectures.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import transformers
from packaging.version import Version

_REGISTRY: dict[str, "Architecture"] = {}
#: architectures left out because the installed transformers is older than their `min_transformers`
_TOO_OLD: dict[str, str] = {}
_PACKAGE_DIR = Path(__file__).parent
ENTRY_POINT_GROUP = "vexact_models.architectures"
_loaded = False


@dataclass(frozen=True)
class Shape:
    """A named shape of an architecture.

    Attributes:
        name: short name (``"moonlight"``); unique within its architecture.
        tiny_config: builds a tiny random-weight config of this shape for CPU tests (kwargs
            override fields).
        published_configs: file names under ``conformance/configs`` with the real sizes this
            tiny shape stands for.
    """

    name: str
    tiny_config: Callable[..., object]
    published_configs: tuple[str, ...] = ()


#: the engine features an architecture may declare missing (`Architecture.rollout_features_missing`)
ROLLOUT_FEATURES = ("cuda_graphs", "pipeline_parallel")


@dataclass(frozen=True)
class Architecture:
    """One supported architecture.

    Attributes:
        name: short name (``"qwen3"``), the folder's name.
        model_types: HF ``config.model_type`` values it serves (no two architectures share one).
        config_class: HF config class.
        causal_lm_class: our training variant (returned by ``AutoModelForCausalLM`` after patch()).
        base_model_class: our base model (returned by ``AutoModel``).
        inference_class: our inference variant.
        shapes: its named shapes; the first is the default (`tiny_config`).
        hf_causal_lm_class: dotted path of the stock transformers class, for HF parity.
        init_for_conformance: ``fn(model, seed)`` giving random values to what random init leaves
            constant and the forward depends on (e.g. DeepSeek's expert-selection bias), so that
            conformance exercises it; None when there is nothing to do.
        sequence_classification_class: our reward-model / critic head, returned by
            ``AutoModelForSequenceClassification`` after patch() (None: HF's head, over our base
            model, which it builds through ``AutoModel``).
        token_classification_class: our per-token head, returned by
            ``AutoModelForTokenClassification`` after patch() (None: as above).
        checkpoint_conversions: whether transformers' own checkpoint conversion for these model
            types (e.g. hub MoE checkpoints storing one tensor per expert) must apply to our
            classes too; `patch()` registers it and `unpatch()` removes it.
        hf_head_classes: ``(head, dotted path)`` of stock transformers classes (head ``"Model"``,
            ``"ForSequenceClassification"``, ...), where the name is not ``hf_causal_lm_class``'s
            with ``ForCausalLM`` replaced (Qwen3.5's text model is ``Qwen3_5TextModel``; its
            ``Qwen3_5Model`` is the multimodal one); for HF parity tests.
        rollout_features_missing: ``(feature, why)`` pairs of the engine features this
            architecture's rollouts cannot use yet (one of `ROLLOUT_FEATURES`): `LLM` raises
            ValueError naming the feature (`check_rollout_feature`) before it allocates, and the
            tests of that feature skip with the reason.
        fp32_parity: the largest relative logit error against stock transformers in float32 that
            the parity tests accept (1e-5; the gated-DeltaNet hybrids 4e-4: stock's fp32 logits are
            up to 3.1e-4 from float64 at these random weights, so their tests bound ours against
            a float64 reference too; docs/design.md section 6b).
        min_transformers: the oldest transformers release whose stock classes this architecture
            has been shown to match (None: every supported release, 5.2 on). On an older release
            `register` keeps it out of the registry (patch() leaves its model types to stock, the
            tests do not see it) and `get` names the release it needs.
    """

    name: str
    model_types: tuple[str, ...]
    config_class: type
    causal_lm_class: type
    base_model_class: type
    inference_class: type
    shapes: tuple[Shape, ...]
    hf_causal_lm_class: str
    init_for_conformance: Callable[..., None] | None = None
    sequence_classification_class: type | None = None
    token_classification_class: type | None = None
    checkpoint_conversions: bool = False
    hf_head_classes: tuple[tuple[str, str], ...] = ()
    rollout_features_missing: tuple[tuple[str, str], ...] = ()
    fp32_parity: float = 1e-5
    min_transformers: str | None = None

    def __post_init__(self) -> None:
        names = [s.name for s in self.shapes]
        if not names:
            raise ValueError(f"Architecture {self.name!r}: shapes is empty; give at least one Shape")
        if len(set(names)) != len(names):
            raise ValueError(f"Architecture {self.name!r}: shape names {names} are not unique")
        unknown = sorted({f for f, _ in self.rollout_features_missing} - set(ROLLOUT_FEATURES))
        if unknown:
            raise ValueError(f"Architecture {self.name!r}: rollout_features_missing names {unknown}, not among "
                             f"{ROLLOUT_FEATURES}")

    def tiny_config(self, **overrides):
        """The default shape's tiny config (`Shape.tiny_config`)."""
        return self.shapes[0].tiny_config(**overrides)

    @property
    def published_configs(self) -> tuple[str, ...]:
        """Every shape's published config file names."""
        return tuple(name for shape in self.shapes for name in shape.published_configs)

    def shape(self, name: str) -> Shape:
        """The shape called `name`, or a ValueError listing this architecture's shapes."""
        for shape in self.shapes:
            if shape.name == name:
                return shape
        raise ValueError(f"architecture {self.name!r} has no shape {name!r}; its shapes: {[s.name for s in self.shapes]}")

    def rollout_feature_missing(self, feature: str) -> str | None:
        """Why the rollout engine cannot use `feature` (one of `ROLLOUT_FEATURES`) for this
        architecture yet, or None when it can."""
        if feature not in ROLLOUT_FEATURES:
            raise ValueError(f"rollout_feature_missing: feature={feature!r} is not one of {ROLLOUT_FEATURES}")
        return dict(self.rollout_features_missing).get(feature)

    def check_rollout_feature(self, feature: str, how: str) -> None:
        """Raise ValueError naming the architecture, the `feature`, why it is missing and `how`
        to do without it, when `rollout_feature_missing` says so."""
        why = self.rollout_feature_missing(feature)
        if why is not None:
            raise ValueError(f"LLM: {feature} is not supported for architecture {self.name!r} yet: {why}; {how}")

    def hf_class(self, head: str = "ForCausalLM") -> type:
        """The stock transformers class of this architecture with `head` (``ForCausalLM``,
        ``Model``, ``ForSequenceClassification``...), whether or not `patch()` is in effect
        (`stock_class`)."""
        return stock_class(dict(self.hf_head_classes).get(head) or self.hf_causal_lm_class.replace("ForCausalLM", head))


def import_path(cls: type) -> str:
    """Where users import our class `cls` from: its architecture package
    (``vexact_models.qwen3.Qwen3ForCausalLM``), for messages."""
    return f"{cls.__module__.rsplit('.', 1)[0]}.{cls.__name__}"


def stock_class(path: str) -> type:
    """The class at dotted `path`. A top-level transformers name (``transformers.Qwen3ForCausalLM``,
    which `patch()` binds to our class) is read from the module transformers defines it in (its
    lazy module's table), so that it is stock's whether or not the process is patched."""
    module, _, name = path.rpartition(".")
    if module == "transformers":
        defined_in = getattr(importlib.import_module("transformers"), "_class_to_module", {}).get(name)
        if defined_in is not None:
            module = f"transformers.{defined_in}"
    return getattr(importlib.import_module(module), name)


def register(arch: Architecture) -> Architecture:
    """Add (or replace, by name) an architecture; returns it. Raises ValueError when another
    architecture already serves one of its model types (lookups by ``model_type`` must be
    unambiguous)."""
    if arch.min_transformers is not None and Version(transformers.__version__) < Version(arch.min_transformers):
        _TOO_OLD[arch.name] = arch.min_transformers
        return arch
    for other in _REGISTRY.values():
        shared = set(other.model_types) & set(arch.model_types)
        if other.name != arch.name and shared:
            raise ValueError(f"register({arch.name!r}): model_type {sorted(shared)} is already served by "
                             f"architecture {other.name!r}; add a Shape to {other.name!r} instead")
    _REGISTRY[arch.name] = arch
    return arch


def builtin_architecture_packages() -> list[str]:
    """Dotted names of the built-in architecture folders: sub-packages of `vexact_models` with a
    ``modeling.py``."""
    return sorted(f"vexact_models.{info.name}" for info in pkgutil.iter_modules([str(_PACKAGE_DIR)])
                  if info.ispkg and (_PACKAGE_DIR / info.name / "modeling.py").is_file())


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True  # set first: the imported modules call back into this registry
    try:
        for module in builtin_architecture_packages():
            importlib.import_module(module)
        for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            entry.load()
    except BaseException:
        _loaded = False  # a later call retries and raises the same error, never a partial registry
        raise


def architectures() -> list[Architecture]:
    """All registered architectures (built-in and entry-point ones are imported on first call)."""
    _load()
    return list(_REGISTRY.values())


def unavailable() -> dict[str, str]:
    """The architectures left out because the installed transformers is older than their
    ``min_transformers``: name -> the release they need (empty on a recent enough transformers)."""
    _load()
    return dict(_TOO_OLD)


def shapes() -> list[tuple[Architecture, Shape]]:
    """Every (architecture, shape) pair, default shapes first within each architecture."""
    return [(arch, shape) for arch in architectures() for shape in arch.shapes]


def get(name: str) -> Architecture:
    """The architecture called `name`, or a ValueError listing the known names (and, when `name`
    is a shape, the architecture it belongs to)."""
    _load()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _TOO_OLD:
        raise ValueError(f"architecture {name!r} needs transformers >= {_TOO_OLD[name]} (the oldest release its "
                         f"stock classes were matched on); transformers {transformers.__version__} is installed")
    owners = [arch.name for arch in _REGISTRY.values() if any(s.name == name for s in arch.shapes)]
    hint = f"; {name!r} is a shape of {owners[0]!r}: get({owners[0]!r}).shape({name!r})" if owners else ""
    raise ValueError(f"unknown architecture {name!r}; registered: {sorted(_REGISTRY)}{hint}")


def for_model_type(model_type: str) -> Architecture | None:
    """The architecture serving HF ``model_type``, if any."""
    _load()
    for arch in _REGISTRY.values():
        if model_type in arch.model_types:
            return arch
    return None
