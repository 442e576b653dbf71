"""The text part of published multimodal checkpoints, for the text classes we serve.

Published Qwen3.5 checkpoints (``Qwen3_5ForConditionalGeneration`` / ``...MoeForConditionalGeneration``:
model_type ``qwen3_5`` / ``qwen3_5_moe``) keep the text model under ``model.language_model.*``
and the vision tower under ``model.visual.*``; published Gemma 3 4B, 12B and 27B
(``Gemma3ForConditionalGeneration``: ``gemma3``) keep it under ``language_model.model.*`` (the
hub's layout, which transformers also writes) beside ``vision_tower.*`` and
``multi_modal_projector.*``. Each config holds the text model's config as ``text_config``.

Every loading route of ours takes the text model from such a checkpoint and skips the rest, with
a one-line notice: every class's ``from_pretrained`` (`load_text_model_of`: the config from
``text_config``, the tensors renamed by `TEXT_KEY_MAPPING`), ``LLM(path)`` and its pipeline
stages (`text_config_of`, `text_tensor_name`), and TRL's ``VexactGRPOTrainer(model=path)``. On
text input the text model's logits are the multimodal model's: there is no image token.
"""

from __future__ import annotations

import copy

import logging
import re

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .hub_config import source_config_dict
from .registry import for_model_type, import_path

logger = logging.getLogger("vexact_models")

#: multimodal model_type -> what its checkpoints hold beside the text model (for the notice)
MULTIMODAL_MODEL_TYPES = {"qwen3_5": "the vision tower (model.visual.*)", "qwen3_5_moe": "the vision tower (model.visual.*)",
                          "gemma3": "the vision tower and its projector (vision_tower.*, multi_modal_projector.*)"}

#: the renames from a multimodal checkpoint's text tensors to the text model's names (as
#: ``from_pretrained(key_mapping=...)`` takes them: regex -> replacement)
TEXT_KEY_MAPPING = {r"^model\.language_model\.": "model.", r"^language_model\.model\.": "model.",
                    r"^language_model\.lm_head\.": "lm_head."}
_TEXT_KEYS = tuple((re.compile(pattern), replacement) for pattern, replacement in TEXT_KEY_MAPPING.items())


def is_multimodal(config: dict | PretrainedConfig) -> bool:
    """Whether `config` (an object or a config dict) is one of the multimodal configs whose text
    model we serve (`MULTIMODAL_MODEL_TYPES`), with a ``text_config``."""
    if isinstance(config, dict):
        return config.get("model_type") in MULTIMODAL_MODEL_TYPES and "text_config" in config
    return getattr(config, "model_type", None) in MULTIMODAL_MODEL_TYPES and hasattr(config, "text_config")


def text_config_of(config: dict | PretrainedConfig) -> PretrainedConfig | dict:
    """A multimodal config's text config, built as transformers builds it for the multimodal
    model (a config dict: through the multimodal config class), a copy whose
    ``tie_word_embeddings`` is the multimodal config's: the multimodal model ties its head by its
    own config's flag (transformers' ``get_expanded_tied_weights_keys``), whatever ``text_config``
    says. Any other config unchanged."""
    if not is_multimodal(config):
        return config
    if isinstance(config, dict):
        fields = {k: v for k, v in config.items() if k != "model_type"}
        config = CONFIG_MAPPING[config["model_type"]].from_dict(fields)
    text = copy.deepcopy(config.get_text_config())
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text


def text_tensor_name(name: str) -> str | None:
    """The text model's name for tensor `name` of a multimodal checkpoint (`TEXT_KEY_MAPPING`; a
    top-level ``lm_head.*`` stays), or None for the other parts (vision tower, projector, MTP)."""
    for pattern, replacement in _TEXT_KEYS:
        renamed, count = pattern.subn(replacement, name, count=1)
        if count:
            return renamed
    return name if name.startswith("lm_head.") else None


def refuse_multimodal_model(who: str, model) -> None:
    """A ValueError where `model` is a multimodal model (stock's, e.g. ``AutoModelForCausalLM`` of
    a Gemma 3 4B+ checkpoint) whose text model we serve, saying how to load that text model."""
    config = getattr(model, "config", None)
    if config is None or not is_multimodal(config):
        return
    arch = for_model_type(text_config_of(config).model_type)
    if arch is None:
        return
    ours = import_path(arch.causal_lm_class)
    raise ValueError(f"{who}: model is a multimodal {type(model).__module__}.{type(model).__qualname__}, whose vision "
                     f"tower vexact-models does not run; load its text model from the checkpoint with "
                     f"{ours}.from_pretrained(path) (LLM(path) does so itself)")


def tell_text_part(who: str, source, model_type: str) -> None:
    """The one-line notice that `who` loads the text model of the multimodal checkpoint `source`."""
    logger.warning("%s: %s is a multimodal %s checkpoint; loading its text model, skipping %s", who, source,
                   model_type, MULTIMODAL_MODEL_TYPES[model_type])


def _finds_text_config(config_class: type, stored: dict) -> bool:
    """Whether ``config_class.from_pretrained`` of the multimodal config dict `stored` reads its
    ``text_config`` by itself (through its ``base_config_key``, or the sub-config of its model_type),
    applying ``from_pretrained``'s config arguments (``num_labels=1``) as for any checkpoint."""
    return getattr(config_class, "base_config_key", "") == "text_config" or \
        stored["text_config"].get("model_type") == config_class.model_type


def load_text_model_of(cls: type, source, kwargs: dict) -> None:
    """Set ``from_pretrained(source, **kwargs)`` of our class `cls` up to load the text model of a
    multimodal checkpoint (module docstring): the config from ``text_config`` (unless one is
    passed; a multimodal config object passed gives its own), the text tensors renamed (unless a
    ``key_mapping`` is passed), with a notice that the other parts are skipped. `kwargs` is
    changed in place; any other checkpoint leaves it as it is. A multimodal checkpoint of another
    family is a ValueError."""
    if is_multimodal(kwargs.get("config")):  # the multimodal config object itself: its text config
        kwargs["config"] = text_config_of(kwargs["config"])
    try:
        stored = source_config_dict(source, kwargs)
    except (OSError, ValueError, TypeError):  # no config with it: transformers' own error, or a config passed
        return
    if not is_multimodal(stored):
        return
    text = text_config_of(stored)
    if not isinstance(text, cls.config_class):
        raise ValueError(f"{cls.__name__}.from_pretrained: {source} is a multimodal {stored['model_type']} "
                         f"checkpoint whose text model is a {text.model_type!r} model, not one of "
                         f"{cls.config_class.model_type!r}")
    tell_text_part(f"{cls.__name__}.from_pretrained", source, stored["model_type"])
    if kwargs.get("config") is None and not _finds_text_config(cls.config_class, stored):
        kwargs["config"] = text
    elif kwargs.get("config") is None:  # transformers reads text_config: the head tied as the multimodal model's
        kwargs.setdefault("tie_word_embeddings", text.tie_word_embeddings)
    kwargs.setdefault("key_mapping", dict(TEXT_KEY_MAPPING))
