"""The text part of Qwen3.5's published multimodal checkpoints (``Qwen3_5ForConditionalGeneration``
/ ``Qwen3_5MoeForConditionalGeneration``: a ``qwen3_5`` / ``qwen3_5_moe`` config with a
``text_config``, text weights under ``model.language_model.*``, the vision tower under
``model.visual.*``). The text config is taken from ``text_config`` and the weights are renamed by
transformers' own conversion for these model types (``Architecture.checkpoint_conversions``);
the vision tower is skipped with a one-line notice."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("vexact_models")

#: the multimodal model types whose text part the text classes load
MULTIMODAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


def multimodal_config(path) -> dict | None:
    """The ``config.json`` of a local multimodal Qwen3.5 checkpoint at `path`, else None."""
    config_file = Path(str(path)) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    return config if config.get("model_type") in MULTIMODAL_MODEL_TYPES and "text_config" in config else None


class TextOfMultimodalMixin:
    """Mixed into the text models' ``PreTrainedModel``: ``from_pretrained`` of a multimodal
    checkpoint loads its text model (config from ``text_config``) and skips the vision tower."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """HF's ``from_pretrained`` (the same parameters, the path by position or by name); a
        multimodal checkpoint gives its text model (the class docstring), with a warning that the
        vision tower is skipped."""
        path = pretrained_model_name_or_path
        full = multimodal_config(path) if kwargs.get("config") is None else None
        if full is not None:
            logger.warning("%s.from_pretrained: %s is a multimodal %s checkpoint; loading its text model "
                           "(model.language_model.*), skipping the vision tower (model.visual.*)",
                           cls.__name__, path, full["model_type"])
            kwargs["config"] = cls.config_class.from_dict(full["text_config"])
        return super().from_pretrained(path, *args, **kwargs)
