"""``vexact export-text``: the text model of a published multimodal checkpoint, written as a text
checkpoint of its own.

Our loading routes read the text part of a published Qwen3.5 or Gemma 3 4B+ checkpoint directly
(`vexact_models.multimodal`). Loaders that build the class a checkpoint names do not: stock's
``AutoModelForCausalLM`` of a Gemma 3 4B+ checkpoint is the multimodal model, as are verl's actor
(``AutoModelForImageTextToText`` for a multimodal config), its critic and TRL's loading of a path.
For them, export the text model once and point them at the export: its config is the text
config (``architectures`` naming stock's text causal LM, ``tie_word_embeddings`` the multimodal
config's, by which the multimodal model ties its head), its tensors are the text model's under
the text class's names, in the dtype and layout stored (per-expert MoE tensors stay per expert:
transformers converts them on load), sharded as transformers shards, with the tokenizer and
generation files copied. stock transformers and, after ``patch()``, our classes load it with
no tensor missing or left over.

The export is written into a temporary folder beside the target and renamed into place at the
end: an interrupted or failed export leaves nothing at the target.
"""

from __future__ import annotations

import os
from pathlib import Path

from tqdm.auto import tqdm
from transformers import AutoConfig

from .checkpoint_writer import (DEFAULT_SHARD_SIZE, ShardWriter, check_target, copy_side_files, shard_bytes,
                                staged_folder)
from .hub_config import TensorReader, checkpoint_folder, stored_tensors
from .multimodal import MULTIMODAL_MODEL_TYPES, is_multimodal, text_config_of, text_tensor_name
from .registry import for_model_type

#: the vision side's files of a multimodal checkpoint (left out of the export)
VISION_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
WHO = "export_text_model"


def export_text_model(source: str | os.PathLike, target: str | os.PathLike, *, max_shard_size: int | str =
                      DEFAULT_SHARD_SIZE, progress: bool = True) -> Path:
    """Write the text model of the multimodal checkpoint `source` (a published Qwen3.5 or Gemma 3
    4B+ checkpoint: a folder, or a hub model id fetched into the hub cache first) to the new
    folder `target` (module docstring); returns `target`. A ValueError, before anything is
    written, for a `source` that is not such a checkpoint or a `target` that
    `checkpoint_writer.check_target` refuses (existing and not an empty folder, ...);
    `max_shard_size` (bytes, or "5GB") bounds each safetensors file as in ``save_pretrained``."""
    target = Path(target)
    limit = shard_bytes(max_shard_size, WHO)
    check_target(target, WHO)  # (before a hub id is fetched)
    source = Path(checkpoint_folder(source, f"{WHO}: source"))
    config = _checked_config(source)
    stored = stored_tensors(source, WHO)
    with staged_folder(target, WHO) as staging:
        text = text_config_of(config)
        text.architectures = [for_model_type(text.model_type).hf_class().__name__]
        if getattr(text, "dtype", None) is None:
            text.dtype = getattr(config, "dtype", None)
        text.save_pretrained(staging)
        _write_tensors(stored, staging, limit, progress)
        copy_side_files(source, staging, skip=VISION_FILES)
    return target


def _checked_config(source: Path):
    """The multimodal config of `source`; a ValueError naming what is wrong."""
    if not (source / "config.json").is_file():
        raise ValueError(f"{WHO}: source {str(source)!r} is not a checkpoint folder (no config.json)")
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:  # (transformers' OSError for a config.json that is no JSON)
        raise ValueError(f"{WHO}: cannot read {str(source / 'config.json')!r}: {error}") from None
    if not is_multimodal(config):
        raise ValueError(f"{WHO}: source {str(source)!r} has model_type {config.model_type!r}, not one of the "
                         f"multimodal model types whose text model vexact-models serves {sorted(MULTIMODAL_MODEL_TYPES)}")
    if for_model_type(text_config_of(config).model_type) is None:
        raise ValueError(f"{WHO}: the text model of {str(source)!r} ({text_config_of(config).model_type!r}) needs a "
                         "newer transformers than the one installed (vexact env lists what is registered)")
    return config


def _write_tensors(stored: dict[str, Path], folder: Path, limit: int, progress: bool) -> None:
    """The text tensors of `stored`, renamed (`text_tensor_name`), into safetensors shards in `folder`."""
    names = sorted((text, name) for name in stored if (text := text_tensor_name(name)) is not None)
    if not names:
        raise ValueError(f"{WHO}: the checkpoint holds no text-model tensors (model.language_model.*, "
                         f"language_model.model.*); its tensors begin {sorted(stored)[:4]}")
    writer, reader = ShardWriter(folder, limit), TensorReader(stored)
    for text, name in tqdm(names, desc="export-text", unit="tensor", disable=not progress):
        writer.add(text, reader.get(name))
    writer.finish()
