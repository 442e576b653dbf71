"""``vexact export-text``: the text model of a published multimodal checkpoint, written as a text
checkpoint of its own.

Our loading routes read the text part of a published Qwen3.5 or Gemma 3 4B+ checkpoint directly
(`vexact_models.multimodal`). Loaders that build the class a checkpoint names do not: stock's
``AutoModelForCausalLM`` of a Gemma 3 4B+ checkpoint is the multimodal model, as are verl's actor
(``AutoModelForImageTextToText`` for a multimodal config), its critic and TRL's loading of a path.
For them, export the text model once and point them at the export: its config is the text
config (``architectures`` naming stock's text causal LM), its tensors are the text model's under
the text class's names, in the dtype and layout stored (per-expert MoE tensors stay per expert:
transformers converts them on load), sharded as transformers shards, with the tokenizer and
generation files copied. stock transformers and, after ``patch()``, our classes load it with
no tensor missing or left over.

The export is written into a temporary folder beside the target and renamed into place at the
end: an interrupted or failed export leaves nothing at the target.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig
from transformers.utils.hub import convert_file_size_to_int

from .hub_config import checkpoint_folder
from .multimodal import MULTIMODAL_MODEL_TYPES, is_multimodal, text_config_of, text_tensor_name
from .registry import for_model_type

#: files of a checkpoint folder that are the model's (rewritten) or the vision side's (left out)
NOT_COPIED = ("config.json", "model.safetensors", "model.safetensors.index.json", "preprocessor_config.json",
              "processor_config.json", "video_preprocessor_config.json")
DEFAULT_SHARD_SIZE = "5GB"


def export_text_model(source: str | os.PathLike, target: str | os.PathLike, *, max_shard_size: int | str =
                      DEFAULT_SHARD_SIZE, progress: bool = True) -> Path:
    """Write the text model of the multimodal checkpoint `source` (a published Qwen3.5 or Gemma 3
    4B+ checkpoint: a folder, or a hub model id fetched into the hub cache first) to the new folder `target` (module
    docstring); returns `target`. A ValueError, before anything is written, for a `source` that is
    not such a checkpoint or a `target` that exists and is not an empty folder;
    `max_shard_size` (bytes, or "5GB") bounds each safetensors file as in ``save_pretrained``."""
    target = Path(target)
    source = Path(checkpoint_folder(source, "export_text_model: source"))
    config, stored = _checked_source(source)
    shard_bytes = _checked_shard_size(max_shard_size)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"export_text_model: target {str(target)!r} exists and is not an empty folder; the export "
                         "writes a new folder and never overwrites")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        text = text_config_of(config)
        arch = for_model_type(text.model_type)
        text.architectures = [arch.hf_class().__name__]
        if getattr(text, "dtype", None) is None:
            text.dtype = getattr(config, "dtype", None)
        text.save_pretrained(staging)
        _write_tensors(stored, staging, shard_bytes, progress)
        for file in sorted(source.iterdir()):
            if file.is_file() and file.name not in NOT_COPIED and not file.name.endswith(".safetensors"):
                shutil.copy2(file, staging / file.name)
        if target.exists():
            target.rmdir()  # empty (checked above)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _checked_source(source: Path) -> tuple[object, dict[str, Path]]:
    """(the multimodal config, stored tensor name -> its safetensors file) of `source`; a
    ValueError naming what is wrong."""
    if not (source / "config.json").is_file():
        raise ValueError(f"export_text_model: source {str(source)!r} is not a checkpoint folder (no config.json)")
    config = AutoConfig.from_pretrained(source)
    if not is_multimodal(config):
        raise ValueError(f"export_text_model: source {str(source)!r} has model_type {config.model_type!r}, not one "
                         f"of the multimodal model types whose text model vexact-models serves "
                         f"{sorted(MULTIMODAL_MODEL_TYPES)}")
    if for_model_type(text_config_of(config).model_type) is None:
        raise ValueError(f"export_text_model: the text model of {str(source)!r} ({text_config_of(config).model_type!r})"
                         " needs a newer transformers than the one installed (vexact env lists what is registered)")
    index = source / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return config, {name: source / file for name, file in weight_map.items()}
    single = source / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"export_text_model: source {str(source)!r} holds no safetensors checkpoint "
                         "(model.safetensors or model.safetensors.index.json)")
    with safe_open(str(single), framework="pt") as handle:
        return config, dict.fromkeys(handle.keys(), single)


def _checked_shard_size(max_shard_size: int | str) -> int:
    try:
        size = convert_file_size_to_int(max_shard_size)
    except (ValueError, TypeError):
        size = None
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"export_text_model: max_shard_size={max_shard_size!r} must be a positive number of bytes "
                         "or a size such as '5GB'")
    return size


def _write_tensors(stored: dict[str, Path], folder: Path, shard_bytes: int, progress: bool) -> None:
    """The text tensors of `stored`, renamed (`text_tensor_name`), into safetensors shards in `folder`."""
    names = sorted((text, name) for name in stored if (text := text_tensor_name(name)) is not None)
    if not names:
        raise ValueError(f"export_text_model: the checkpoint holds no text-model tensors (model.language_model.*, "
                         f"language_model.model.*); its tensors begin {sorted(stored)[:4]}")
    writer = _ShardWriter(folder, shard_bytes)
    handles: dict[Path, object] = {}
    for text, name in tqdm(names, desc="export-text", unit="tensor", disable=not progress):
        path = stored[name]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        writer.add(text, handles[path].get_tensor(name))
    writer.finish()


class _ShardWriter:
    """Tensors into safetensors files of at most `limit` bytes each (a larger tensor alone in its
    file), written as each fills, so memory holds one shard at a time; named and indexed as
    ``save_pretrained`` names them (``model.safetensors``, or ``model-00001-of-0000N.safetensors``
    and ``model.safetensors.index.json``)."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.pending: dict = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str], int]] = []  # (file, tensor names, bytes)

    def add(self, name: str, tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size

    def _flush(self) -> None:
        if not self.pending:
            return
        file = f"part-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(self.folder / file), metadata={"format": "pt"})
        self.written.append((file, sorted(self.pending), self.pending_bytes))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Write what is pending and give the files their final names (and the index)."""
        self._flush()
        if len(self.written) == 1:
            os.replace(self.folder / self.written[0][0], self.folder / "model.safetensors")
            return
        weight_map = {}
        for number, (file, names, _) in enumerate(self.written, start=1):
            final = f"model-{number:05d}-of-{len(self.written):05d}.safetensors"
            os.replace(self.folder / file, self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": sum(size for _, _, size in self.written)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
