"""Published GPT-OSS checkpoints store the experts in MXFP4 (``quantization_config`` with
``quant_method: mxfp4``; ``gate_up_proj_blocks`` / ``_scales`` instead of ``gate_up_proj``).

The aligned kernels run the experts in bf16 (`kernels.fused_moe`), so such a checkpoint loads only
as transformers dequantizes it: with ``quantization_config=Mxfp4Config(dequantize=True)`` passed
to ``from_pretrained`` (transformers' own dequantize path, which turns the blocks and scales into
the bf16 ``gate_up_proj`` / ``down_proj`` tensors these classes hold). Without it,
`Mxfp4LoadingMixin` refuses before anything is built, saying what to pass, instead of letting
transformers swap in its MXFP4 kernels, which these classes do not run.
"""

from __future__ import annotations

import os

from transformers import PretrainedConfig


def mxfp4_quantized(config: object) -> bool:
    """Whether `config` (a config object or dict) says its checkpoint holds MXFP4 weights."""
    quant = config.get("quantization_config") if isinstance(config, dict) else \
        getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method)) == "mxfp4"


def dequantize_requested(quantization_config: object) -> bool:
    """Whether a ``from_pretrained(quantization_config=...)`` argument asks for MXFP4 dequantization."""
    if isinstance(quantization_config, dict):
        return bool(quantization_config.get("dequantize", False))
    return bool(getattr(quantization_config, "dequantize", False))


class Mxfp4LoadingMixin:
    """Mixed into GPT-OSS's ``PreTrainedModel``: ``from_pretrained`` of an MXFP4 checkpoint needs
    ``quantization_config=Mxfp4Config(dequantize=True)`` (module docstring), else a ValueError
    saying so."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        config = kwargs.get("config")
        if config is None or isinstance(config, (str, os.PathLike)):
            source = pretrained_model_name_or_path if config is None else config
            hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder")
                   if k in kwargs}
            config, _ = PretrainedConfig.get_config_dict(source, **hub)
        if mxfp4_quantized(config) and not dequantize_requested(kwargs.get("quantization_config")):
            raise ValueError(
                f"{cls.__name__}.from_pretrained({str(pretrained_model_name_or_path)!r}): the checkpoint stores its "
                "experts in MXFP4 (quantization_config quant_method 'mxfp4'), which the aligned kernels do not run. "
                "Load it dequantized to bf16: pass quantization_config=transformers.Mxfp4Config(dequantize=True) and "
                "dtype=torch.bfloat16 (or save such a load with save_pretrained once and load that folder)")
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
