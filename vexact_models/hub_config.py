"""The config a ``from_pretrained(source, **kwargs)`` call reads, before anything loads: what the
loading mixins (MXFP4 checkpoints, the text part of multimodal checkpoints) decide on."""

from __future__ import annotations

import os

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


def source_config_dict(source, kwargs: dict) -> dict:
    """The config dict stored with the checkpoint `source` itself (a folder or a hub id), whatever
    config ``kwargs`` passes: what the checkpoint's tensors are laid out for."""
    hub = {k: kwargs[k] for k in HUB_ARGUMENTS if k in kwargs}
    config, _ = PretrainedConfig.get_config_dict(source, **hub)
    return config
