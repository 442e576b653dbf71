"""Where a checkpoint comes from: the config a ``from_pretrained(source, **kwargs)`` call reads,
before anything loads (what the loading mixins, MXFP4 checkpoints and the text part of multimodal
checkpoints, decide on), a local folder for a hub model id (`checkpoint_folder`: ``LLM(id)``,
``vexact export-text``), and which safetensors file holds each of a folder's tensors
(`stored_tensors`, read by `TensorReader`: the pipeline stages' loader, the checkpoint-rewriting
commands)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from safetensors import safe_open
from transformers import PretrainedConfig

#: ``from_pretrained`` arguments that say where a hub checkpoint's files are
HUB_ARGUMENTS = ("cache_dir", "revision", "token", "local_files_only", "subfolder", "force_download", "proxies")


def checkpoint_config(source, kwargs: dict) -> dict | PretrainedConfig:
    """The config ``from_pretrained(source, **kwargs)`` would read: ``kwargs["config"]`` when it is
    a config, else the config dict of that path (or of `source`: a folder or a hub id), with the
    hub arguments given."""
    config = kwargs.get("config")
    if config is None or isinstance(config, (str, os.PathLike)):
        return source_config_dict(source if config is None else config, kwargs)
    return config


def quant_method(config: object) -> str | None:
    """The ``quantization_config.quant_method`` of `config` (a config object or dict), as a string
    (``"mxfp4"``, ``"fp8"``, ...), or None for an unquantized checkpoint."""
    quant = config.get("quantization_config") if isinstance(config, dict) else \
        getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def dequantize_requested(quantization_config: object) -> bool:
    """Whether a ``from_pretrained(quantization_config=...)`` argument asks transformers to
    dequantize the checkpoint (``Mxfp4Config`` / ``FineGrainedFP8Config(dequantize=True)``)."""
    if isinstance(quantization_config, dict):
        return bool(quantization_config.get("dequantize", False))
    return bool(getattr(quantization_config, "dequantize", False))


def source_config_dict(source, kwargs: dict) -> dict:
    """The config dict stored with the checkpoint `source` itself (a folder or a hub id), whatever
    config ``kwargs`` passes: what the checkpoint's tensors are laid out for."""
    hub = {k: kwargs[k] for k in HUB_ARGUMENTS if k in kwargs}
    config, _ = PretrainedConfig.get_config_dict(source, **hub)
    return config


#: what `checkpoint_folder` fetches of a hub model: configs, safetensors weights, tokenizer files
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def checkpoint_folder(source: str | os.PathLike, who: str) -> str:
    """A local checkpoint folder for `source`: itself when it is a folder, else a hub model id
    (``Qwen/Qwen3-8B``) fetched as vLLM fetches it (`HUB_FILES`, into the hub cache, or found
    there: ``HF_HUB_OFFLINE=1`` reads the cache only). A ValueError naming the argument `who`
    (``"LLM: model"``) and `source` when it is neither a folder nor a model the hub (or its cache)
    holds."""
    path = os.fspath(source)
    if os.path.isdir(path):
        return path
    try:
        return snapshot_download(path, allow_patterns=HUB_FILES)
    except (HfHubHTTPError, HFValidationError, OSError, ValueError) as error:
        raise ValueError(f"{who}={path!r} is neither a checkpoint folder nor a hub model id this machine can "
                         f"fetch or find in its hub cache ({type(error).__name__}: {error})") from None


def stored_tensors(source: str | os.PathLike, who: str) -> dict[str, Path]:
    """Stored tensor name -> the safetensors file holding it, of the checkpoint folder `source`
    (from its index, else its single file's header); a ValueError from `who` when it has neither."""
    source = Path(source)
    index = source / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: source / file for name, file in weight_map.items()}
    single = source / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{who}: source {str(source)!r} holds no safetensors checkpoint "
                         "(model.safetensors or model.safetensors.index.json)")
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


class TensorReader:
    """Reads single tensors by stored name out of a checkpoint's safetensors `files` (name -> file,
    as `stored_tensors` gives them), each file opened once."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._handles: dict[Path, object] = {}

    def get(self, name: str):
        """The stored tensor `name`."""
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)
