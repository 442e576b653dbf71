"""Where a checkpoint comes from: the config a ``from_pretrained(source, **kwargs)`` call reads,
before anything loads (what the loading mixins, MXFP4 checkpoints and the text part of multimodal
checkpoints, decide on), and a local folder for a hub model id (`checkpoint_folder`: ``LLM(id)``,
``vexact export-text``)."""

from __future__ import annotations

import os

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from transformers import PretrainedConfig

#: ``from_pretrained`` arguments that say where a hub checkpoint's files are
HUB_ARGUMENTS = ("cache_dir", "revision", "token", "local_files_only", "subfolder", "force_download", "proxies")


def checkpoint_config(source, kwargs: dict) -> dict | PretrainedConfig:
    """The config ``from_pretrained(source, **kwargs)`` would read: ``kwargs["config"]`` when it is
    a config, else the config dict of that path (or of `source`: a folder or a hub id), with the
    hub arguments given."""
    config = kwargs.get("config")
    if config is None or isinstance(config, (str, os.PathLike)):
        hub = {k: kwargs[k] for k in HUB_ARGUMENTS if k in kwargs}
        config, _ = PretrainedConfig.get_config_dict(source if config is None else config, **hub)
    return config


def dequantize_requested(quantization_config: object) -> bool:
    """Whether a ``from_pretrained(quantization_config=...)`` argument asks for MXFP4 dequantization."""
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
