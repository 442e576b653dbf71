"""MXFP4 checkpoints: published GPT-OSS checkpoints store the experts in MXFP4 (``quantization_config``
with ``quant_method: mxfp4``; ``gate_up_proj_blocks`` / ``_scales`` instead of ``gate_up_proj``,
and ``down_proj_blocks`` / ``_scales``).

The aligned kernels run the experts in bf16 (`kernels.fused_moe`), so such a checkpoint loads
dequantized, by one of two routes that give the same tensors (tests/models/test_gpt_oss_mxfp4.py):

- ``from_pretrained(path, quantization_config=transformers.Mxfp4Config(dequantize=True))``:
  transformers' own dequantize path (``integrations.mxfp4.convert_moe_packed_tensors``, plain
  torch, on CPU as on a GPU; no kernels hub), for our classes as for stock's, with or without
  `vexact_models.patch()`. Without it, our ``from_pretrained`` refuses before anything is built
  (`loading.refuse_quantized_checkpoint`), saying what to pass, instead of letting transformers
  swap in its MXFP4 kernels, which these classes do not run.
- the rollout engine's own loading (``LLM(path)``, `loading.from_pretrained_complete`, which
  passes the above itself, and the pipeline stages' loader, `runtime.pipeline_load`, which reads
  the safetensors and dequantizes with `dequantize_mxfp4`).

The format (the OCP microscaling format as GPT-OSS's checkpoints and transformers lay it out): a
weight ``[experts, out, in]`` (the transpose of the model's ``[experts, in, out]``) is stored in
groups of 32 consecutive ``in`` values; ``<name>_blocks`` (uint8 ``[experts, out, in / 32, 16]``)
holds each group's 32 e2m1 (FP4) codes, two a byte, the even element in the low nibble;
``<name>_scales`` (uint8 ``[experts, out, in / 32]``) each group's e8m0 scale ``2**(s - 127)``.
"""

from __future__ import annotations

import torch

from .hub_config import quant_method

#: the value of each 4-bit e2m1 code (sign bit, two exponent bits, one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: the suffixes of the two stored tensors that replace a weight ``<name>``
BLOCKS, SCALES = "_blocks", "_scales"


#: what our ``from_pretrained`` says of an MXFP4 checkpoint loaded without dequantization
#: (`loading.refuse_quantized_checkpoint`)
MXFP4_ADVICE = ("the checkpoint stores its experts in MXFP4 (quantization_config quant_method 'mxfp4'), which the "
                "aligned kernels do not run. Load it dequantized to bf16: pass quantization_config="
                "transformers.Mxfp4Config(dequantize=True) and dtype=torch.bfloat16 (or save such a load with "
                "save_pretrained once and load that folder); vexact_models.LLM(path) dequantizes by itself")


def mxfp4_quantized(config: object) -> bool:
    """Whether `config` (a config object or dict) says its checkpoint holds MXFP4 weights."""
    return quant_method(config) == "mxfp4"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The model's weight ``[experts, in, out]`` in `dtype` from a checkpoint's MXFP4 pair (module
    docstring): `blocks` uint8 ``[experts, out, groups, 16]``, `scales` uint8 ``[experts, out,
    groups]``; ``in = groups * 32``. Exact: each value is an FP4 value (two significant bits) times a
    power of two, which bf16 and fp32 hold exactly (within their exponent range), so the result is
    bitwise transformers' ``convert_moe_packed_tensors``. One expert at a time (a bounded
    temporary). ValueError for tensors of another dtype or shape, naming them."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"dequantize_mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"dequantize_mxfp4: blocks must be [experts, out, groups, 16] and scales [experts, out, "
                         f"groups]; got {tuple(blocks.shape)} and {tuple(scales.shape)}")
    experts, rows, groups, _ = blocks.shape
    out = torch.empty((experts, groups * 32, rows), dtype=dtype, device=blocks.device)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    for e in range(experts):
        codes = blocks[e].long()
        values = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).reshape(rows, groups, 32)
        values = torch.ldexp(values, (scales[e].to(torch.int32) - 127)[..., None].float())
        out[e] = values.reshape(rows, groups * 32).t().to(dtype)
    return out
