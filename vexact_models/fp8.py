"""FP8 checkpoints: published DeepSeek-V3 (and its R1 and V3.1 releases) and the ``-FP8`` releases
of Qwen3 store their linear weights in float8 (e4m3) with a float32 inverse scale per block of
rows x columns (``<name>.weight_scale_inv``, shape ``[ceil(rows / b0), ceil(cols / b1)]``;
``quantization_config`` with ``quant_method: fp8`` and ``weight_block_size: [b0, b1]``, 128 x 128
in the published ones).

The aligned kernels run the weights in bf16, so such a checkpoint is dequantized once, into a
checkpoint of its own: ``vexact dequantize-fp8 SOURCE TARGET`` (`dequantize_fp8_checkpoint`).
Each weight is its FP8 values times its block's scale in fp32, rounded once to bf16
(`dequantize_fp8`): transformers' own dequantization arithmetic
(``FineGrainedFP8Config(dequantize=True)``, the same bits where it takes the shape; it refuses a
weight whose rows are not a whole number of blocks, as DeepSeek-V3's 576-row
``kv_a_proj_with_mqa`` is, and a partial last block here just takes its scale). Every other
tensor is copied as stored; the config loses its ``quantization_config``. Our classes'
``from_pretrained`` (and so ``LLM(path)``) refuses an FP8 checkpoint unless transformers is asked
to dequantize it (``FineGrainedFP8Config(dequantize=True)``), naming the command
(`loading.refuse_quantized_checkpoint`): transformers
would otherwise swap in its FP8 layers, which these classes do not run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .checkpoint_writer import (DEFAULT_SHARD_SIZE, ShardWriter, check_target, copy_side_files, shard_bytes,
                                staged_folder)
from .hub_config import TensorReader, checkpoint_folder, quant_method, stored_tensors

__all__ = ["FP8_ADVICE", "dequantize_fp8", "dequantize_fp8_checkpoint", "fp8_quantized"]

SCALE = "_scale_inv"
WHO = "dequantize_fp8_checkpoint"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


#: what our ``from_pretrained`` says of an FP8 checkpoint loaded without dequantization
#: (`loading.refuse_quantized_checkpoint`)
FP8_ADVICE = ("the checkpoint stores its weights in FP8 (quantization_config quant_method 'fp8'), which the aligned "
              "kernels do not run. Dequantize it to bf16 once (vexact dequantize-fp8 SOURCE TARGET, then load TARGET), "
              "or pass quantization_config=transformers.FineGrainedFP8Config(dequantize=True) where transformers "
              "takes the checkpoint's shapes")


def fp8_quantized(config: object) -> bool:
    """Whether `config` (a config object or dict) says its checkpoint holds block-FP8 weights."""
    return quant_method(config) == "fp8"


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight`` (FP8, ``[..., rows, cols]``) times its blocks' scales (``[..., ceil(rows /
    block[0]), ceil(cols / block[1])]``, a partial last block taking its own), in fp32, rounded
    once to `dtype`. A ValueError for a scale grid that does not fit."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != (*weight.shape[:-2], *grid) or not scale_inv.dtype.is_floating_point:
        raise ValueError(f"dequantize_fp8: a weight of shape {tuple(weight.shape)} in blocks of {tuple(block)} needs "
                         f"float scales of shape {(*weight.shape[:-2], *grid)}, got {tuple(scale_inv.shape)} "
                         f"{scale_inv.dtype}")
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def dequantize_fp8_checkpoint(source: str | os.PathLike, target: str | os.PathLike, *,
                              max_shard_size: int | str = DEFAULT_SHARD_SIZE, progress: bool = True) -> Path:
    """Write the FP8 checkpoint `source` (a folder, or a hub model id fetched into the hub cache
    first) dequantized to bf16 into the new folder `target` (module docstring); returns `target`.
    A ValueError, before anything is written, for a `source` that is not a block-FP8 checkpoint or
    a `target` that `checkpoint_writer.check_target` refuses (existing and not an empty folder, ...)."""
    target = Path(target)
    limit = shard_bytes(max_shard_size, WHO)
    check_target(target, WHO)  # (before a hub id is fetched)
    source = Path(checkpoint_folder(source, f"{WHO}: source"))
    config, block = _checked_config(source)
    stored = stored_tensors(source, WHO)
    with staged_folder(target, WHO) as staging:
        _write_tensors(stored, staging, block, limit, progress)
        config.pop("quantization_config")
        config["torch_dtype"] = config["dtype"] = "bfloat16"
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copy_side_files(source, staging)
    return target


def _checked_config(source: Path) -> tuple[dict, tuple[int, int]]:
    """(the config dict of `source`, its weight block); a ValueError naming what is wrong."""
    path = source / "config.json"
    if not path.is_file():
        raise ValueError(f"{WHO}: source {str(source)!r} is not a checkpoint folder (no config.json)")
    try:
        config = json.loads(path.read_text())
    except ValueError as error:  # (JSONDecodeError, UnicodeDecodeError)
        raise ValueError(f"{WHO}: {str(path)!r} is not valid JSON: {error}") from None
    if not fp8_quantized(config):
        raise ValueError(f"{WHO}: source {str(source)!r} is not an FP8 checkpoint (its quantization_config has no "
                         "quant_method 'fp8')")
    block = config["quantization_config"].get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{WHO}: source {str(source)!r} has weight_block_size={block!r}; block-FP8 checkpoints "
                         "give two positive ints")
    return config, (block[0], block[1])


def _write_tensors(stored: dict[str, Path], folder: Path, block: tuple[int, int], limit: int, progress: bool) -> None:
    """Every tensor of `stored` into safetensors shards in `folder`: each FP8 weight dequantized
    with its scales (which are dropped), the others as stored. A ValueError for an FP8 tensor
    without scales."""
    writer, reader = ShardWriter(folder, limit), TensorReader(stored)
    names = sorted(n for n in stored if not n.endswith(SCALE))
    for name in tqdm(names, desc="dequantize-fp8", unit="tensor", disable=not progress):
        tensor = reader.get(name)
        if tensor.dtype in FP8_DTYPES:
            if name + SCALE not in stored:
                raise ValueError(f"{WHO}: {name} is stored in {tensor.dtype} without {name + SCALE}")
            tensor = dequantize_fp8(tensor, reader.get(name + SCALE), block)
        writer.add(name, tensor)
    writer.finish()
